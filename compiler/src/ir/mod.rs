//! A thin typed layer over melior's operation builders, so emitters read like the code they
//! generate (`b.addf(x, y)`, `b.for_range(..)`) instead of attribute plumbing.
//!
//! Every method appends one operation to the current block and returns its result. Nested
//! regions (`scf.for`, `scf.if`) take a closure that receives a builder for the inner block.
//! Float constants are written as hexadecimal bit patterns so they are exact.

mod float;
mod int8;
mod memory;
mod vector;

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
    pub fn i64c(&self, v: i64) -> Value<'c, 'a> {
        self.op1(
            "arith.constant",
            &[],
            self.ty("i64"),
            &[("value", self.attr(&format!("{v} : i64")))],
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
