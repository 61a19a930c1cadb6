//! A thin typed layer over melior's operation builders, so emitters read like the code they
//! generate (`b.addf(x, y)`, `b.for_range(..)`) instead of attribute plumbing.
//!
//! Every method appends one operation to the current block and returns its result. Nested
//! regions (`scf.for`, `scf.if`) take a closure that receives a builder for the inner block.
//! Float constants are written as hexadecimal bit patterns so they are exact.

mod int8;

use kiln_core::DType;
use melior::{
    Context,
    ir::{
        Attribute, Block, BlockLike, Identifier, Location, Region, RegionLike, Type, TypeLike, Value, ValueLike,
        attribute::TypeAttribute, operation::OperationBuilder,
    },
};

/// Floating-point flags for reductions and accumulations that may be reassociated: without
/// them LLVM keeps reductions scalar and in order.
pub const FAST: &str = "#arith.fastmath<fast>";

/// Flags for a maximum whose operands are never NaN: no NaN test, either zero for `max(-0, +0)`.
const NO_NAN: &str = "#arith.fastmath<nnan,nsz>";

/// Builder appending operations to one block.
#[derive(Clone, Copy)]
pub struct Kb<'c, 'a> {
    pub ctx: &'c Context,
    pub loc: Location<'c>,
    pub blk: &'a Block<'c>,
}

/// Integer comparison predicates of `arith.cmpi`, by their MLIR numbering.
#[derive(Clone, Copy)]
pub enum Cmp {
    Eq = 0,
    Ne = 1,
    Slt = 2,
    Sle = 3,
    Sgt = 4,
    Sge = 5,
    Ult = 6,
    Ule = 7,
    Ugt = 8,
    Uge = 9,
}

impl<'c, 'a> Kb<'c, 'a> {
    // ---- types and attributes -------------------------------------------------------------

    pub fn ty(&self, text: &str) -> Type<'c> {
        Type::parse(self.ctx, text).unwrap_or_else(|| panic!("emitter wrote an invalid MLIR type: {text}"))
    }
    pub fn attr(&self, text: &str) -> Attribute<'c> {
        Attribute::parse(self.ctx, text).unwrap_or_else(|| panic!("emitter wrote an invalid MLIR attribute: {text}"))
    }
    pub fn index_ty(&self) -> Type<'c> {
        Type::index(self.ctx)
    }
    pub fn f32_ty(&self) -> Type<'c> {
        Type::float32(self.ctx)
    }
    pub fn vec_ty(&self, lanes: usize, elem: &str) -> Type<'c> {
        self.ty(&format!("vector<{lanes}x{elem}>"))
    }

    /// Appends a generic operation with explicit result types.
    pub fn op(
        &self,
        name: &str,
        operands: &[Value<'c, '_>],
        results: &[Type<'c>],
        attrs: &[(&str, Attribute<'c>)],
    ) -> Vec<Value<'c, 'a>> {
        let attrs: Vec<_> = attrs.iter().map(|(n, a)| (Identifier::new(self.ctx, n), *a)).collect();
        let op = OperationBuilder::new(name, self.loc)
            .add_operands(operands)
            .add_results(results)
            .add_attributes(&attrs)
            .build()
            .unwrap_or_else(|e| panic!("emitter built an invalid {name}: {e}"));
        let op = self.blk.append_operation(op);
        (0..results.len())
            .map(|i| op.result(i).expect("result exists").into())
            .collect()
    }
    fn op1(
        &self,
        name: &str,
        operands: &[Value<'c, '_>],
        result: Type<'c>,
        attrs: &[(&str, Attribute<'c>)],
    ) -> Value<'c, 'a> {
        self.op(name, operands, &[result], attrs)[0]
    }

    // ---- constants ---------------------------------------------------------------------------

    pub fn idx(&self, v: usize) -> Value<'c, 'a> {
        self.op1(
            "arith.constant",
            &[],
            self.index_ty(),
            &[("value", self.attr(&format!("{v} : index")))],
        )
    }
    pub fn f32c(&self, v: f32) -> Value<'c, 'a> {
        self.op1(
            "arith.constant",
            &[],
            self.f32_ty(),
            &[("value", self.attr(&format!("0x{:08X} : f32", v.to_bits())))],
        )
    }
    pub fn i32c(&self, v: i32) -> Value<'c, 'a> {
        self.op1(
            "arith.constant",
            &[],
            self.ty("i32"),
            &[("value", self.attr(&format!("{v} : i32")))],
        )
    }
    /// A vector of `lanes` copies of `v`.
    pub fn f32_splat(&self, v: f32, lanes: usize) -> Value<'c, 'a> {
        let t = format!("vector<{lanes}xf32>");
        self.op1(
            "arith.constant",
            &[],
            self.ty(&t),
            &[("value", self.attr(&format!("dense<0x{:08X}> : {t}", v.to_bits())))],
        )
    }
    /// A splat constant of any integer element type.
    pub fn int_splat(&self, v: i64, lanes: usize, elem: &str) -> Value<'c, 'a> {
        let t = format!("vector<{lanes}x{elem}>");
        self.op1(
            "arith.constant",
            &[],
            self.ty(&t),
            &[("value", self.attr(&format!("dense<{v}> : {t}")))],
        )
    }
    /// A zero of the same type as `like` (scalar f32 or vector of f32).
    pub fn zero_like(&self, lanes: usize) -> Value<'c, 'a> {
        if lanes == 1 {
            self.f32c(0.0)
        } else {
            self.f32_splat(0.0, lanes)
        }
    }

    // ---- index arithmetic --------------------------------------------------------------------

    pub fn addi(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.addi", &[a, b], a.r#type(), &[])
    }
    pub fn subi(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.subi", &[a, b], a.r#type(), &[])
    }
    pub fn muli(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.muli", &[a, b], a.r#type(), &[])
    }
    pub fn divui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.divui", &[a, b], a.r#type(), &[])
    }
    pub fn remui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.remui", &[a, b], a.r#type(), &[])
    }
    pub fn ceildivui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.ceildivui", &[a, b], a.r#type(), &[])
    }
    pub fn minui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.minui", &[a, b], a.r#type(), &[])
    }
    pub fn maxui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.maxui", &[a, b], a.r#type(), &[])
    }
    /// Integer comparison: an `i1`, or a vector of `i1` lanes for vector operands.
    pub fn cmpi(&self, pred: Cmp, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        let i1 = if a.r#type().is_vector() {
            self.retyped(a, "i1")
        } else {
            self.ty("i1")
        };
        self.op1(
            "arith.cmpi",
            &[a, b],
            i1,
            &[("predicate", self.attr(&format!("{} : i64", pred as i64)))],
        )
    }
    pub fn select(&self, c: Value<'c, '_>, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.select", &[c, a, b], a.r#type(), &[])
    }
    /// `i64`/`i32` → `index` (or back).
    pub fn index_cast(&self, v: Value<'c, '_>, to: Type<'c>) -> Value<'c, 'a> {
        self.op1("arith.index_cast", &[v], to, &[])
    }
    /// `v` unchanged, but opaque to LLVM's optimisers (an empty inline-asm statement that
    /// claims to rewrite it): a loop bound made with it is not a constant, so the loop is kept
    /// as a loop instead of being unrolled and rescheduled. Costs nothing at run time.
    pub fn opaque_index(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        let wide = self.index_cast(v, self.ty("i64"));
        self.index_cast(self.opaque(wide), self.index_ty())
    }
    /// An integer or vector value unchanged but opaque to LLVM (see [`Self::opaque_index`]):
    /// it stops LLVM from folding the shuffles that made a vector into the ones that use it.
    pub fn opaque(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        let constraint = if v.r#type().is_vector() { "=x,0" } else { "=r,0" };
        self.op1(
            "llvm.inline_asm",
            &[v],
            v.r#type(),
            &[
                ("asm_string", self.attr("\"\"")),
                ("constraints", self.attr(&format!("\"{constraint}\""))),
            ],
        )
    }
    /// Unsigned index → f32 (positions for RoPE angles).
    pub fn index_to_f32(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        let i64t = self.ty("i64");
        let i = self.index_cast(v, i64t);
        self.op1("arith.uitofp", &[i], self.f32_ty(), &[])
    }

    // ---- float arithmetic (scalars or vectors; `fast` allows reassociation and contraction) ----

    fn fop(&self, name: &str, a: Value<'c, '_>, b: Value<'c, '_>, fast: bool) -> Value<'c, 'a> {
        let attrs: Vec<(&str, Attribute<'c>)> = if fast {
            vec![("fastmath", self.attr(FAST))]
        } else {
            vec![]
        };
        self.op1(name, &[a, b], a.r#type(), &attrs)
    }
    pub fn addf(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.addf", a, b, false)
    }
    pub fn subf(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.subf", a, b, false)
    }
    pub fn mulf(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.mulf", a, b, false)
    }
    pub fn divf(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.divf", a, b, false)
    }
    pub fn maxf(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.maximumf", a, b, false)
    }
    /// The larger of two non-NaN values (one `vmaxps`; `arith.maximumf` adds a NaN test and a
    /// blend to every step).
    pub fn max_no_nan(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.maxnumf", &[a, b], a.r#type(), &[("fastmath", self.attr(NO_NAN))])
    }
    /// Reassociable add, for reductions whose order does not matter.
    pub fn addf_fast(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.fop("arith.addf", a, b, true)
    }
    pub fn negf(&self, a: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.negf", &[a], a.r#type(), &[])
    }
    /// `a * b + c` with a single rounding (scalar `math.fma` or `vector.fma`).
    pub fn fma(&self, a: Value<'c, '_>, b: Value<'c, '_>, c: Value<'c, '_>) -> Value<'c, 'a> {
        let name = if a.r#type().is_vector() {
            "vector.fma"
        } else {
            "math.fma"
        };
        self.op1(name, &[a, b, c], a.r#type(), &[])
    }
    /// `e^x` by range reduction and a polynomial, vectorised (LLVM would otherwise call the
    /// scalar `expf` once per lane). `x = n ln2 + r` with `|r| <= ln2/2`, `e^r` by a degree-7
    /// minimax polynomial (Cephes' `expf` coefficients), scaled by `2^n` through the exponent
    /// bits. Accurate to about 1 ulp over the normal range; inputs are clamped to
    /// [-87.3, 88.7] so the result is finite and, below, a tiny positive number instead of 0.
    pub fn exp(&self, x: Value<'c, '_>) -> Value<'c, 'a> {
        let lanes = lanes_of(x);
        let c = |v: f32| {
            if lanes == 1 {
                self.f32c(v)
            } else {
                self.f32_splat(v, lanes)
            }
        };
        let x = self.fop("arith.minimumf", x, c(88.722_83), false);
        let x = self.fop("arith.maximumf", x, c(-87.336_54), false);
        // n = floor(x / ln2 + 0.5)
        let n = self.op1(
            "math.floor",
            &[self.fma(x, c(std::f32::consts::LOG2_E), c(0.5))],
            x.r#type(),
            &[],
        );
        // r = x - n ln2, with ln2 split in two for accuracy.
        let r = self.fma(n, c(-0.693_359_4), x);
        let r = self.fma(n, c(2.121_944_4e-4), r);
        let mut p = c(1.987_569_1e-4);
        for coeff in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = self.fma(p, r, c(coeff));
        }
        let r2 = self.mulf(r, r);
        let y = self.addf(self.fma(p, r2, r), c(1.0));
        // 2^n from the exponent bits.
        let (ti, tf) = if lanes == 1 {
            (self.ty("i32"), self.f32_ty())
        } else {
            (self.vec_ty(lanes, "i32"), self.vec_ty(lanes, "f32"))
        };
        let ni = self.op1("arith.fptosi", &[n], ti, &[]);
        let bias = if lanes == 1 {
            self.i32c(127)
        } else {
            self.int_splat(127, lanes, "i32")
        };
        let shift = if lanes == 1 {
            self.i32c(23)
        } else {
            self.int_splat(23, lanes, "i32")
        };
        let bits = self.op1(
            "arith.shli",
            &[self.op1("arith.addi", &[ni, bias], ti, &[]), shift],
            ti,
            &[],
        );
        let scale = self.op1("arith.bitcast", &[bits], tf, &[]);
        self.mulf(y, scale)
    }
    pub fn sqrt(&self, a: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("math.sqrt", &[a], a.r#type(), &[])
    }
    /// Natural logarithm (scalars: a call of the C library's `logf`, correctly rounded to
    /// within an ulp like torch's).
    pub fn log(&self, a: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("math.log", &[a], a.r#type(), &[])
    }
    pub fn cos(&self, a: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("math.cos", &[a], a.r#type(), &[])
    }
    pub fn sin(&self, a: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("math.sin", &[a], a.r#type(), &[])
    }
    /// A constant of `x`'s shape (scalar or splat).
    pub fn f32_like(&self, x: Value<'c, '_>, v: f32) -> Value<'c, 'a> {
        self.f32_splat_or_scalar(v, lanes_of(x))
    }
    /// `v` as a scalar (`lanes = 1`) or splat over `lanes`.
    pub fn f32_splat_or_scalar(&self, v: f32, lanes: usize) -> Value<'c, 'a> {
        match lanes {
            1 => self.f32c(v),
            n => self.f32_splat(v, n),
        }
    }
    /// `tanh(x)`, vectorised (LLVM would call the scalar `tanhf` per lane), as Cephes' `tanhf`
    /// computes it: `x + x^3 P(x^2)` below `|x| = 0.625`, `1 - 2 / (e^{2|x|} + 1)` with the
    /// sign of `x` above; about 2 ulp. Saturates to ±1 for large `|x|`.
    pub fn tanh(&self, x: Value<'c, '_>) -> Value<'c, 'a> {
        let c = |v: f32| self.f32_like(x, v);
        let ax = self.op1("math.absf", &[x], x.r#type(), &[]);
        // Large: 1 - 2 / (exp(2|x|) + 1), with `exp` clamped so it stays finite.
        let e = self.exp(self.mulf(ax, c(2.0)));
        let large = self.subf(c(1.0), self.divf(c(2.0), self.addf(e, c(1.0))));
        let large = self.op1("math.copysign", &[large, x], x.r#type(), &[]);
        // Small: x + x * z * P(z), z = x^2.
        let z = self.mulf(x, x);
        let mut p = c(-5.704_988_7e-3);
        for coeff in [2.063_909e-2, -5.373_971_5e-2, 1.333_144_2e-1, -3.333_328e-1] {
            p = self.fma(p, z, c(coeff));
        }
        let small = self.fma(self.mulf(p, z), x, x);
        let is_small = self.cmpf("olt", ax, c(0.625));
        self.select(is_small, small, large)
    }
    /// `erf(x)`, vectorised: Eigen's rational approximation for f32 (`x` clamped to ±4, where
    /// `erf` is ±1 in f32), a few ulp.
    pub fn erf(&self, x: Value<'c, '_>) -> Value<'c, 'a> {
        let c = |v: f32| self.f32_like(x, v);
        let x = self.fop("arith.minimumf", x, c(4.0), false);
        let x = self.fop("arith.maximumf", x, c(-4.0), false);
        let x2 = self.mulf(x, x);
        let mut p = c(-2.726_142_3e-10);
        for coeff in [
            2.770_681_4e-8,
            -2.101_024e-6,
            -5.692_506_4e-5,
            -7.349_906_3e-4,
            -2.954_600_5e-3,
            -1.609_603_3e-2,
        ] {
            p = self.fma(x2, p, c(coeff));
        }
        let p = self.mulf(x, p);
        let mut q = c(-1.456_607_2e-5);
        for coeff in [-2.133_740_6e-4, -1.682_827e-3, -7.373_329_2e-3, -1.426_474e-2] {
            q = self.fma(x2, q, c(coeff));
        }
        self.divf(p, q)
    }
    /// An ordered float comparison (`oeq`, `ogt`, `oge`, `olt`, `ole`), scalar or lane-wise.
    pub fn cmpf(&self, pred: &str, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        let code = match pred {
            "oeq" => 1,
            "ogt" => 2,
            "oge" => 3,
            "olt" => 4,
            "ole" => 5,
            other => panic!("unknown float predicate {other}"),
        };
        let ty = match lanes_of(a) {
            1 => self.ty("i1"),
            n => self.ty(&format!("vector<{n}xi1>")),
        };
        self.op1(
            "arith.cmpf",
            &[a, b],
            ty,
            &[("predicate", self.attr(&format!("{code} : i64")))],
        )
    }

    // ---- vectors -------------------------------------------------------------------------------

    pub fn broadcast(&self, scalar: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
        let t = self.vec_ty(lanes, "f32");
        self.op1("vector.broadcast", &[scalar], t, &[])
    }
    /// Sum of the lanes, reassociated (a tree of shuffles and adds).
    pub fn reduce_add(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        if !v.r#type().is_vector() {
            return self.op1("arith.addf", &[v, self.f32c(0.0)], self.f32_ty(), &[]);
        }
        self.op1(
            "vector.reduction",
            &[v],
            self.f32_ty(),
            &[("kind", self.attr("#vector.kind<add>")), ("fastmath", self.attr(FAST))],
        )
    }

    /// `vector.shuffle`: lanes of `a` then `b` picked by `mask` (indices into their
    /// concatenation).
    pub fn shuffle(&self, a: Value<'c, '_>, b: Value<'c, '_>, mask: &[usize]) -> Value<'c, 'a> {
        let list: Vec<String> = mask.iter().map(|i| i.to_string()).collect();
        let t = self.vec_ty(mask.len(), "f32");
        self.op1(
            "vector.shuffle",
            &[a, b],
            t,
            &[("mask", self.attr(&format!("array<i64: {}>", list.join(", "))))],
        )
    }
    /// Lane `i` of an f32 vector.
    pub fn extract(&self, v: Value<'c, '_>, i: usize) -> Value<'c, 'a> {
        self.extract_lane(v, i)
    }
    /// Lane `i` of a vector of any element type.
    pub fn extract_lane(&self, v: Value<'c, '_>, i: usize) -> Value<'c, 'a> {
        self.op1(
            "vector.extract",
            &[v],
            self.ty(&elem_of(v)),
            &[("static_position", self.attr(&format!("array<i64: {i}>")))],
        )
    }
    /// `v` with lane `i` replaced by the scalar `s`.
    pub fn insert_lane(&self, s: Value<'c, '_>, v: Value<'c, '_>, i: usize) -> Value<'c, 'a> {
        self.op1(
            "vector.insert",
            &[s, v],
            v.r#type(),
            &[("static_position", self.attr(&format!("array<i64: {i}>")))],
        )
    }

    /// The lane sums of several vectors at once, by a tree of shuffles that folds pairs of
    /// vectors together (about two operations per sum instead of a full reduction each).
    /// Sums are reassociated, like [`Kb::reduce_add`].
    ///
    /// Level by level, pairs of vectors are folded into one whose lanes are split into
    /// segments, one per input, in input order: `[v0 | v1]`, then `[v0 | v1 | v2 | v3]`, ...;
    /// finally each segment is folded within the vector and its first lane holds the sum.
    pub fn reduce_many(&self, vs: &[Value<'c, 'a>]) -> Vec<Value<'c, 'a>> {
        let lanes = lanes_of(vs[0]);
        if lanes == 1 {
            return vs.iter().map(|&v| self.reduce_add(v)).collect();
        }
        if vs.len() > lanes {
            // One tree per `lanes` vectors; each vector's sum is formed the same way.
            return vs.chunks(lanes).flat_map(|c| self.reduce_many(c)).collect();
        }
        let (v, width) = self.fold_tree(vs);
        (0..vs.len()).map(|i| self.extract(v, i * width)).collect()
    }

    /// The folding tree of [`Kb::reduce_many`] for at most `lanes` vectors: a vector holding
    /// the sum of `vs[i]` in lane `i * width`, and `width`.
    fn fold_tree(&self, vs: &[Value<'c, 'a>]) -> (Value<'c, 'a>, usize) {
        let lanes = lanes_of(vs[0]);
        let groups = vs.len().next_power_of_two();
        let zero = self.f32_splat(0.0, lanes);
        let mut level: Vec<Value<'c, 'a>> = (0..groups).map(|i| vs.get(i).copied().unwrap_or(zero)).collect();
        // `seg`: lanes per segment of the vectors in `level`.
        let mut seg = lanes;
        while level.len() > 1 {
            let half = seg / 2;
            level = level.chunks(2).map(|p| self.fold_pair(p[0], p[1], seg)).collect();
            seg = half;
        }
        let mut v = level[0];
        while seg > 1 {
            let half = seg / 2;
            let mask: Vec<usize> = (0..lanes).map(|i| if i % seg < half { i + half } else { i }).collect();
            v = self.addf_fast(v, self.shuffle(v, v, &mask));
            seg = half;
        }
        (v, lanes / groups)
    }

    /// One node of [`Kb::fold_tree`]'s tree: `a` and `b` hold sums in segments of `seg` lanes;
    /// the result holds, per segment, the low halves' sums of `a` and `b` added to their high
    /// halves' (segments of `seg / 2`).
    fn fold_pair(&self, a: Value<'c, '_>, b: Value<'c, '_>, seg: usize) -> Value<'c, 'a> {
        let lanes = lanes_of(a);
        let half = seg / 2;
        let (mut lo, mut hi) = (Vec::with_capacity(lanes), Vec::with_capacity(lanes));
        for base in [0, lanes] {
            for s in (0..lanes).step_by(seg) {
                lo.extend((s..s + half).map(|i| base + i));
                hi.extend((s + half..s + seg).map(|i| base + i));
            }
        }
        self.addf_fast(self.shuffle(a, b, &lo), self.shuffle(a, b, &hi))
    }

    /// Adds `v`, the next of `lanes` vectors whose lane sums are wanted as one vector (lane `i`
    /// = the sum of vector `i`), to a running fold: the tree of [`Kb::reduce_many`] (pairs of
    /// neighbours, level by level), each pair combined as soon as both halves exist, so at most
    /// `log2(lanes) + 1` partial sums are live where folding the whole slice kept every input
    /// until the end. After the last vector `fold` holds one value, the sum vector.
    pub fn fold_next(&self, fold: &mut Vec<(Value<'c, 'a>, usize)>, v: Value<'c, 'a>) {
        let lanes = lanes_of(v);
        fold.push((v, 0));
        while let [.., (a, la), (b, lb)] = fold[..]
            && la == lb
        {
            fold.truncate(fold.len() - 2);
            fold.push((self.fold_pair(a, b, lanes >> la), la + 1));
        }
    }

    /// The largest lane of a vector.
    pub fn reduce_max(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1(
            "vector.reduction",
            &[v],
            self.f32_ty(),
            &[("kind", self.attr("#vector.kind<maximumf>"))],
        )
    }
    /// The largest lane of `v`, none of which is NaN ([`Kb::max_no_nan`]).
    pub fn reduce_max_no_nan(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1(
            "vector.reduction",
            &[v],
            self.f32_ty(),
            &[
                ("kind", self.attr("#vector.kind<maxnumf>")),
                ("fastmath", self.attr(NO_NAN)),
            ],
        )
    }

    /// Lane `i` of `v` in every lane.
    pub fn splat_lane(&self, v: Value<'c, '_>, i: usize) -> Value<'c, 'a> {
        let lanes = lanes_of(v);
        self.shuffle(v, v, &vec![i; lanes])
    }

    /// `a < b` lane by lane (ordered), as a vector of i1.
    pub fn cmpf_olt(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        let lanes = lanes_of(a);
        self.op1(
            "arith.cmpf",
            &[a, b],
            self.vec_ty(lanes, "i1"),
            &[("predicate", self.attr("4 : i64"))],
        )
    }

    // ---- integer vectors (quantised weights) ------------------------------------------------------

    /// A constant vector of integers (`elem` = `i8`, `i32`, ...), one value per lane.
    pub fn int_vec(&self, vals: &[i64], elem: &str) -> Value<'c, 'a> {
        let t = format!("vector<{}x{elem}>", vals.len());
        let list: Vec<String> = vals.iter().map(|v| v.to_string()).collect();
        self.op1(
            "arith.constant",
            &[],
            self.ty(&t),
            &[("value", self.attr(&format!("dense<[{}]> : {t}", list.join(", "))))],
        )
    }
    /// A constant vector of f32 values, one per lane (exact: written by their bits).
    pub fn f32_vec(&self, vals: &[f32]) -> Value<'c, 'a> {
        let t = format!("vector<{}xf32>", vals.len());
        let list: Vec<String> = vals.iter().map(|v| format!("0x{:08X}", v.to_bits())).collect();
        self.op1(
            "arith.constant",
            &[],
            self.ty(&t),
            &[("value", self.attr(&format!("dense<[{}]> : {t}", list.join(", "))))],
        )
    }
    pub fn andi(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.andi", &[a, b], a.r#type(), &[])
    }
    pub fn ori(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.ori", &[a, b], a.r#type(), &[])
    }
    /// Logical (zero-filling) right shift.
    pub fn shrui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.shrui", &[a, b], a.r#type(), &[])
    }
    pub fn shli(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.shli", &[a, b], a.r#type(), &[])
    }
    /// The same lanes as `v` with element type `elem` (`vector<NxT>` → `vector<Nxelem>`).
    fn retyped(&self, v: Value<'c, '_>, elem: &str) -> Type<'c> {
        let lanes = lanes_of(v);
        if v.r#type().is_vector() {
            self.vec_ty(lanes, elem)
        } else {
            self.ty(elem)
        }
    }
    /// Zero-extends integer lanes to `elem`.
    pub fn extui(&self, v: Value<'c, '_>, elem: &str) -> Value<'c, 'a> {
        self.op1("arith.extui", &[v], self.retyped(v, elem), &[])
    }
    /// Sign-extends integer lanes to `elem`.
    pub fn extsi(&self, v: Value<'c, '_>, elem: &str) -> Value<'c, 'a> {
        self.op1("arith.extsi", &[v], self.retyped(v, elem), &[])
    }
    /// Narrower float lanes (f16, bf16) → f32, exactly.
    pub fn extf(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.extf", &[v], self.retyped(v, "f32"), &[])
    }
    /// Unsigned integer lanes → f32 (exact below 2^24).
    pub fn uitofp(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.uitofp", &[v], self.retyped(v, "f32"), &[])
    }
    /// Signed integer lanes → f32 (exact below 2^24 in magnitude).
    pub fn sitofp(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.sitofp", &[v], self.retyped(v, "f32"), &[])
    }
    /// `vector.bitcast`: the same bits as another vector type.
    pub fn vbitcast(&self, v: Value<'c, '_>, to: &str) -> Value<'c, 'a> {
        self.op1("vector.bitcast", &[v], self.ty(to), &[])
    }
    /// `arith.bitcast`: the same bits lane by lane as another element type of equal width.
    pub fn bitcast(&self, v: Value<'c, '_>, elem: &str) -> Value<'c, 'a> {
        self.op1("arith.bitcast", &[v], self.retyped(v, elem), &[])
    }
    /// `vector.shuffle` of vectors of any element type (see [`Kb::shuffle`]).
    pub fn shuffle_any(&self, a: Value<'c, '_>, b: Value<'c, '_>, mask: &[usize]) -> Value<'c, 'a> {
        let list: Vec<String> = mask.iter().map(|i| i.to_string()).collect();
        let elem = elem_of(a);
        let t = self.vec_ty(mask.len(), &elem);
        self.op1(
            "vector.shuffle",
            &[a, b],
            t,
            &[("mask", self.attr(&format!("array<i64: {}>", list.join(", "))))],
        )
    }
    /// Lanes `offset..offset + size` of a vector.
    pub fn slice(&self, v: Value<'c, '_>, offset: usize, size: usize) -> Value<'c, 'a> {
        let t = self.vec_ty(size, &elem_of(v));
        self.op1(
            "vector.extract_strided_slice",
            &[v],
            t,
            &[
                ("offsets", self.attr(&format!("[{offset} : i64]"))),
                ("sizes", self.attr(&format!("[{size} : i64]"))),
                ("strides", self.attr("[1 : i64]")),
            ],
        )
    }
    /// Calls an LLVM intrinsic (a target instruction MLIR has no op for) with one result.
    pub fn intrinsic(&self, name: &str, operands: &[Value<'c, '_>], result: Type<'c>) -> Value<'c, 'a> {
        self.op1(
            "llvm.call_intrinsic",
            operands,
            result,
            &[
                ("intrin", self.attr(&format!("\"{name}\""))),
                ("op_bundle_sizes", self.attr("array<i32>")),
                (
                    "operandSegmentSizes",
                    self.attr(&format!("array<i32: {}, 0>", operands.len())),
                ),
            ],
        )
    }

    // ---- memory ----------------------------------------------------------------------------------

    /// Loads `lanes` consecutive f32 (1 = a scalar load).
    pub fn load_f32(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize) -> Value<'c, 'a> {
        self.load_raw(mem, idx, lanes, "f32")
    }
    /// Loads `lanes` consecutive `elem` values (1 = a scalar load).
    pub fn load_vec(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize, elem: &str) -> Value<'c, 'a> {
        self.load_raw(mem, idx, lanes, elem)
    }
    fn load_raw(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize, elem: &str) -> Value<'c, 'a> {
        let mut ops = vec![mem];
        ops.extend_from_slice(idx);
        if lanes == 1 {
            self.op1("memref.load", &ops, self.ty(elem), &[])
        } else {
            self.op1("vector.load", &ops, self.vec_ty(lanes, elem), &[])
        }
    }
    /// Loads `lanes` consecutive weights of type `dtype` and widens them to f32. bf16 is widened
    /// by a 16-bit shift of the integer bits (exact, and cheaper than a conversion instruction).
    pub fn load_weight(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize, dtype: DType) -> Value<'c, 'a> {
        match dtype {
            DType::F32 => self.load_f32(mem, idx, lanes),
            DType::F16 => {
                let h = self.load_raw(mem, idx, lanes, "f16");
                let t = if lanes == 1 {
                    self.f32_ty()
                } else {
                    self.vec_ty(lanes, "f32")
                };
                self.op1("arith.extf", &[h], t, &[])
            }
            DType::BF16 => {
                let raw = self.load_raw(mem, idx, lanes, "bf16");
                let (t16, t32, tf) = if lanes == 1 {
                    (self.ty("i16"), self.ty("i32"), self.f32_ty())
                } else {
                    (
                        self.vec_ty(lanes, "i16"),
                        self.vec_ty(lanes, "i32"),
                        self.vec_ty(lanes, "f32"),
                    )
                };
                let bits = self.op1("arith.bitcast", &[raw], t16, &[]);
                let wide = self.op1("arith.extui", &[bits], t32, &[]);
                let sixteen = if lanes == 1 {
                    self.op1("arith.constant", &[], t32, &[("value", self.attr("16 : i32"))])
                } else {
                    self.int_splat(16, lanes, "i32")
                };
                let shifted = self.op1("arith.shli", &[wide, sixteen], t32, &[]);
                self.op1("arith.bitcast", &[shifted], tf, &[])
            }
            // `compile` rejects kernels over quantised weights before emitting anything.
            q => unreachable!("{q} weights have no element-wise load"),
        }
    }
    /// Stores `lanes` f32 (a vector, or a scalar for 1) into a memref of `dtype`: as they are
    /// for f32, rounded to nearest even for f16 or bf16 (as `vcvtps2ph` and `vcvtneps2bf16`
    /// round).
    pub fn store_as(
        &self,
        value: Value<'c, '_>,
        lanes: usize,
        dtype: DType,
        mem: Value<'c, '_>,
        idx: &[Value<'c, '_>],
    ) {
        let narrow = match dtype {
            DType::F32 => return self.store(value, mem, idx),
            DType::F16 => {
                let t = if lanes == 1 {
                    self.ty("f16")
                } else {
                    self.vec_ty(lanes, "f16")
                };
                self.op1("arith.truncf", &[value], t, &[])
            }
            DType::BF16 => self.round_to_bf16(value, lanes),
            q => unreachable!("a {q} value cannot be stored element-wise"),
        };
        self.store(narrow, mem, idx);
    }
    /// f32 → bf16, to nearest even, in integer arithmetic: `(bits + 0x7fff + lsb) >> 16`, a NaN
    /// made a quiet NaN. What `vcvtneps2bf16` computes, spelled out because without AVX512-BF16
    /// LLVM lowers `arith.truncf` to bf16 into a call of compiler-rt's `__truncsfbf2`, which a
    /// kernel library does not link.
    fn round_to_bf16(&self, v: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
        let int = |x: i64| {
            if lanes == 1 {
                self.op1(
                    "arith.constant",
                    &[],
                    self.ty("i32"),
                    &[("value", self.attr(&format!("{x} : i32")))],
                )
            } else {
                self.int_splat(x, lanes, "i32")
            }
        };
        let bits = self.bitcast(v, "i32");
        let lsb = self.andi(self.shrui(bits, int(16)), int(1));
        let rounded = self.shrui(self.addi(bits, self.addi(int(0x7fff), lsb)), int(16));
        let quiet_nan = self.ori(self.shrui(bits, int(16)), int(64));
        // `uno`: true where either operand is NaN.
        let nan_ty = if lanes == 1 {
            self.ty("i1")
        } else {
            self.vec_ty(lanes, "i1")
        };
        let is_nan = self.op1("arith.cmpf", &[v, v], nan_ty, &[("predicate", self.attr("14 : i64"))]);
        let picked = self.select(is_nan, quiet_nan, rounded);
        let half = self.op1("arith.trunci", &[picked], self.retyped(v, "i16"), &[]);
        self.bitcast(half, "bf16")
    }
    /// Loads `n` consecutive bf16 as they are (a `vector<nxbf16>`).
    pub fn load_bf16s(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], n: usize) -> Value<'c, 'a> {
        self.load_raw(mem, idx, n, "bf16")
    }
    /// Loads `n` consecutive f32 and rounds them to bf16 (to nearest even): the activations
    /// of `--precision bf16`. Only emitted for CPUs with AVX512-BF16, whose `vcvtne2ps2bf16`
    /// LLVM selects (elsewhere `arith.truncf` to bf16 would call compiler-rt).
    pub fn load_as_bf16(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], n: usize) -> Value<'c, 'a> {
        let x = self.load_f32(mem, idx, n);
        self.op1("arith.truncf", &[x], self.vec_ty(n, "bf16"), &[])
    }
    /// `acc + a[2i] * b[2i] + a[2i + 1] * b[2i + 1]` per f32 lane of `acc` (`vdpbf16ps`: 16,
    /// 8 or 4 lanes, twice as many bf16 from each operand; the products are exact, the sums
    /// rounded in f32, lane by lane the same at every width).
    pub fn dot_bf16_pairs(&self, acc: Value<'c, '_>, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        let name = match lanes_of(acc) {
            16 => "llvm.x86.avx512bf16.dpbf16ps.512",
            8 => "llvm.x86.avx512bf16.dpbf16ps.256",
            4 => "llvm.x86.avx512bf16.dpbf16ps.128",
            l => panic!("vdpbf16ps has no {l}-lane form"),
        };
        self.intrinsic(name, &[acc, a, b], acc.r#type())
    }
    /// Loads `n` consecutive bytes as a `vector<nxi8>` (no alignment assumed).
    pub fn load_bytes(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], n: usize) -> Value<'c, 'a> {
        let mut ops = vec![mem];
        ops.extend_from_slice(idx);
        self.op1("vector.load", &ops, self.vec_ty(n, "i8"), &[])
    }
    /// Reads the little-endian IEEE half at byte `idx` of an i8 memref and returns it as f32
    /// broadcast to `lanes` lanes (the conversion is exact).
    pub fn load_f16_splat(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize) -> Value<'c, 'a> {
        let raw = self.load_bytes(mem, idx, 2);
        let h = self.vbitcast(raw, "vector<1xf16>");
        let wide = self.op1("vector.broadcast", &[h], self.vec_ty(lanes, "f16"), &[]);
        self.op1("arith.extf", &[wide], self.vec_ty(lanes, "f32"), &[])
    }
    /// A hint to bring the cache line holding `mem[idx]` into the caches ahead of its use.
    pub fn prefetch(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>]) {
        self.prefetch_with(mem, idx, 3)
    }
    /// [`Kb::prefetch`] with an explicit locality (3 = all cache levels … 0 = non-temporal).
    pub fn prefetch_with(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>], locality: u32) {
        let mut ops = vec![mem];
        ops.extend_from_slice(idx);
        let attrs = [
            ("isWrite", self.attr("false")),
            ("localityHint", self.attr(&format!("{locality} : i32"))),
            ("isDataCache", self.attr("true")),
        ];
        self.op("memref.prefetch", &ops, &[], &attrs);
    }
    /// Loads one i32 and returns it as an index.
    pub fn load_i32_index(&self, mem: Value<'c, '_>, idx: &[Value<'c, '_>]) -> Value<'c, 'a> {
        let v = self.load_raw(mem, idx, 1, "i32");
        let i64t = self.ty("i64");
        let w = self.op1("arith.extui", &[v], i64t, &[]);
        self.index_cast(w, self.index_ty())
    }
    /// Stores a scalar or a vector.
    /// A statically shaped stack buffer of type `ty` (e.g. `memref<4x64xf32>`), 64-byte aligned,
    /// private to the calling thread and alive until the kernel returns.
    /// A heap buffer (`memref.alloc`: `malloc` in the compiled library), for buffers too large
    /// for a thread's stack; freed with [`Kb::dealloc`] before the kernel returns.
    pub fn alloc(&self, ty: &str) -> Value<'c, 'a> {
        let ty = self.ty(ty);
        self.op(
            "memref.alloc",
            &[],
            &[ty],
            &[
                ("alignment", self.attr("64 : i64")),
                ("operandSegmentSizes", self.attr("array<i32: 0, 0>")),
            ],
        )[0]
    }

    pub fn dealloc(&self, mem: Value<'c, '_>) {
        self.op("memref.dealloc", &[mem], &[], &[]);
    }

    pub fn alloca(&self, ty: &str) -> Value<'c, 'a> {
        let ty = self.ty(ty);
        self.op(
            "memref.alloca",
            &[],
            &[ty],
            &[
                ("alignment", self.attr("64 : i64")),
                ("operandSegmentSizes", self.attr("array<i32: 0, 0>")),
            ],
        )[0]
    }

    pub fn store(&self, value: Value<'c, '_>, mem: Value<'c, '_>, idx: &[Value<'c, '_>]) {
        let mut ops = vec![value, mem];
        ops.extend_from_slice(idx);
        let name = if value.r#type().is_vector() {
            "vector.store"
        } else {
            "memref.store"
        };
        self.op(name, &ops, &[], &[]);
    }

    // ---- control flow ----------------------------------------------------------------------------

    /// `scf.for` from `lb` to `ub` by `step`, carrying `inits`; the body returns the next values.
    pub fn for_range<F>(
        &self,
        lb: Value<'c, '_>,
        ub: Value<'c, '_>,
        step: Value<'c, '_>,
        inits: &[Value<'c, '_>],
        body: F,
    ) -> Vec<Value<'c, 'a>>
    where
        F: for<'b> FnOnce(Kb<'c, 'b>, Value<'c, 'b>, Vec<Value<'c, 'b>>) -> Vec<Value<'c, 'b>>,
    {
        let mut args = vec![(self.index_ty(), self.loc)];
        args.extend(inits.iter().map(|v| (v.r#type(), self.loc)));
        let block = Block::new(&args);
        {
            let inner = Kb {
                ctx: self.ctx,
                loc: self.loc,
                blk: &block,
            };
            let iv: Value = block.argument(0).expect("induction variable").into();
            let carried: Vec<Value> = (1..args.len())
                .map(|i| block.argument(i).expect("iter arg").into())
                .collect();
            let next = body(inner, iv, carried);
            assert_eq!(
                next.len(),
                inits.len(),
                "scf.for body must yield one value per carried value"
            );
            inner.op("scf.yield", &next, &[], &[]);
        }
        let region = Region::new();
        region.append_block(block);
        let types: Vec<Type> = inits.iter().map(|v| v.r#type()).collect();
        let mut operands = vec![lb, ub, step];
        operands.extend_from_slice(inits);
        let op = OperationBuilder::new("scf.for", self.loc)
            .add_operands(&operands)
            .add_results(&types)
            .add_regions([region])
            .build()
            .expect("valid scf.for");
        let op = self.blk.append_operation(op);
        (0..types.len()).map(|i| op.result(i).expect("result").into()).collect()
    }

    /// A loop without carried values.
    pub fn for_each<F>(&self, lb: Value<'c, '_>, ub: Value<'c, '_>, step: Value<'c, '_>, body: F)
    where
        F: for<'b> FnOnce(Kb<'c, 'b>, Value<'c, 'b>),
    {
        self.for_range(lb, ub, step, &[], |b, iv, _| {
            body(b, iv);
            vec![]
        });
    }

    /// `scf.while` carrying `inits`: `next(carried)` computes the loop condition and the values
    /// forwarded to `body`; `body(forwarded)` returns the next carried values.
    pub fn while_loop<N, F>(&self, inits: &[Value<'c, '_>], next: N, body: F)
    where
        N: for<'b> FnOnce(Kb<'c, 'b>, Vec<Value<'c, 'b>>) -> (Value<'c, 'b>, Vec<Value<'c, 'b>>),
        F: for<'b> FnOnce(Kb<'c, 'b>, Vec<Value<'c, 'b>>) -> Vec<Value<'c, 'b>>,
    {
        let carried_types: Vec<Type> = inits.iter().map(|v| v.r#type()).collect();
        let block_args =
            |types: &[Type<'c>]| -> Vec<(Type<'c>, Location<'c>)> { types.iter().map(|&t| (t, self.loc)).collect() };
        let arguments = |block: &Block<'c>, count: usize| -> Vec<Value<'c, '_>> {
            (0..count)
                .map(|i| block.argument(i).expect("block argument").into())
                .collect()
        };
        let before = Block::new(&block_args(&carried_types));
        let forwarded_types = {
            let inner = Kb {
                ctx: self.ctx,
                loc: self.loc,
                blk: &before,
            };
            let (cond, forwarded) = next(inner, arguments(&before, carried_types.len()));
            let types: Vec<Type> = forwarded.iter().map(|v| v.r#type()).collect();
            let mut operands = vec![cond];
            operands.extend(forwarded);
            inner.op("scf.condition", &operands, &[], &[]);
            types
        };
        let after = Block::new(&block_args(&forwarded_types));
        {
            let inner = Kb {
                ctx: self.ctx,
                loc: self.loc,
                blk: &after,
            };
            let next_carried = body(inner, arguments(&after, forwarded_types.len()));
            assert_eq!(
                next_carried.len(),
                inits.len(),
                "scf.while body must yield one value per carried value"
            );
            inner.op("scf.yield", &next_carried, &[], &[]);
        }
        let (before_region, after_region) = (Region::new(), Region::new());
        before_region.append_block(before);
        after_region.append_block(after);
        let op = OperationBuilder::new("scf.while", self.loc)
            .add_operands(inits)
            .add_results(&forwarded_types)
            .add_regions([before_region, after_region])
            .build()
            .expect("valid scf.while");
        self.blk.append_operation(op);
    }

    /// Atomically adds one to the i64 at `counter[0]` and returns its previous value as an
    /// index (sequentially consistent).
    pub fn fetch_inc(&self, counter: Value<'c, '_>) -> Value<'c, 'a> {
        let one = self.op1(
            "arith.constant",
            &[],
            self.ty("i64"),
            &[("value", self.attr("1 : i64"))],
        );
        let zero = self.idx(0);
        let old = self.op1(
            "memref.atomic_rmw",
            &[one, counter, zero],
            self.ty("i64"),
            &[("kind", self.attr("1 : i64"))],
        );
        self.index_cast(old, self.index_ty())
    }

    /// `scf.if` without results.
    pub fn if_then<F>(&self, cond: Value<'c, '_>, then: F)
    where
        F: for<'b> FnOnce(Kb<'c, 'b>),
    {
        let block = Block::new(&[]);
        {
            let inner = Kb {
                ctx: self.ctx,
                loc: self.loc,
                blk: &block,
            };
            then(inner);
            inner.op("scf.yield", &[], &[], &[]);
        }
        let then_region = Region::new();
        then_region.append_block(block);
        let op = OperationBuilder::new("scf.if", self.loc)
            .add_operands(&[cond])
            .add_regions([then_region, Region::new()])
            .build()
            .expect("valid scf.if");
        self.blk.append_operation(op);
    }
}

/// Builds `func.func @name(args) -> ()` whose body is written by `body`, marked public (the
/// exported kernel) or private (a helper that must not clash between separately compiled
/// objects).
pub fn build_func<'c, F>(
    ctx: &'c Context,
    name: &str,
    arg_types: &[Type<'c>],
    public: bool,
    body: F,
) -> melior::ir::Operation<'c>
where
    F: for<'b> FnOnce(Kb<'c, 'b>, Vec<Value<'c, 'b>>),
{
    let loc = Location::unknown(ctx);
    let block = Block::new(&arg_types.iter().map(|t| (*t, loc)).collect::<Vec<_>>());
    {
        let b = Kb { ctx, loc, blk: &block };
        let args: Vec<Value> = (0..arg_types.len())
            .map(|i| block.argument(i).expect("argument").into())
            .collect();
        body(b, args);
        b.op("func.return", &[], &[], &[]);
    }
    let region = Region::new();
    region.append_block(block);
    let inputs: Vec<String> = arg_types.iter().map(|t| t.to_string()).collect();
    let fty = Type::parse(ctx, &format!("({}) -> ()", inputs.join(", "))).expect("function type");
    let mut attrs = vec![
        (
            Identifier::new(ctx, "sym_name"),
            Attribute::parse(ctx, &format!("\"{name}\"")).expect("symbol name"),
        ),
        (Identifier::new(ctx, "function_type"), TypeAttribute::new(fty).into()),
    ];
    if !public {
        attrs.push((
            Identifier::new(ctx, "sym_visibility"),
            Attribute::parse(ctx, "\"private\"").expect("visibility"),
        ));
    }
    OperationBuilder::new("func.func", loc)
        .add_attributes(&attrs)
        .add_regions([region])
        .build()
        .expect("valid func.func")
}

/// Lanes of a `vector<Nxf32>` value (1 for a scalar).
pub(crate) fn lanes_of(v: Value<'_, '_>) -> usize {
    let ty = v.r#type().to_string();
    ty.strip_prefix("vector<")
        .and_then(|rest| rest.split('x').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Element type of a vector value (`f32`, `i8`, ...), or the type itself for a scalar.
fn elem_of(v: Value<'_, '_>) -> String {
    let ty = v.r#type().to_string();
    match ty.strip_prefix("vector<").and_then(|rest| rest.strip_suffix('>')) {
        Some(inner) => inner.rsplit('x').next().unwrap_or(&ty).to_string(),
        None => ty,
    }
}

/// Chooses the vector width for a loop over `dim` elements: the widest power of two not above
/// `max_lanes` that divides `dim`, so no remainder loop is ever needed (1 = scalar code).
pub fn lanes_for(dim: usize, max_lanes: usize) -> usize {
    let mut lanes = max_lanes.max(1);
    while lanes > 1 && !dim.is_multiple_of(lanes) {
        lanes /= 2;
    }
    lanes
}

#[cfg(test)]
mod tests {
    use super::lanes_for;

    #[test]
    fn lanes_divide_the_dimension() {
        assert_eq!(lanes_for(896, 16), 16);
        assert_eq!(lanes_for(136, 16), 8);
        assert_eq!(lanes_for(20, 16), 4);
        assert_eq!(lanes_for(7, 8), 1);
    }
}
