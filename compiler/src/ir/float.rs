//! Float arithmetic on scalars and vectors: the basic operations, `exp` and the other
//! functions emitters need, comparisons.

use super::*;

impl<'c, 'a> Kb<'c, 'a> {
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
}
