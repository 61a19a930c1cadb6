//! Vector operations: broadcasts, shuffles, lane reductions (the fold trees that turn many
//! vectors of partial sums into one of sums), and integer vectors for quantised weights.

use super::*;

impl<'c, 'a> Kb<'c, 'a> {
    // ---- vectors -------------------------------------------------------------------------------

    pub fn broadcast(&self, scalar: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
        let t = self.vec_ty(lanes, "f32");
        self.op1("vector.broadcast", &[scalar], t, &[])
    }
    /// A vector of `lanes` copies of a scalar of any element type.
    pub fn splat_scalar(&self, scalar: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
        let t = self.vec_ty(lanes, &scalar.r#type().to_string());
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
    pub fn xori(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.xori", &[a, b], a.r#type(), &[])
    }
    /// Logical (zero-filling) right shift.
    pub fn shrui(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.shrui", &[a, b], a.r#type(), &[])
    }
    pub fn shli(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.op1("arith.shli", &[a, b], a.r#type(), &[])
    }
    /// The same lanes as `v` with element type `elem` (`vector<NxT>` → `vector<Nxelem>`).
    pub(super) fn retyped(&self, v: Value<'c, '_>, elem: &str) -> Type<'c> {
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
    /// Two vectors of one type side by side, `[x | y]` (one `vector.shuffle`).
    pub fn concat(&self, x: Value<'c, '_>, y: Value<'c, '_>) -> Value<'c, 'a> {
        self.shuffle_any(x, y, &(0..2 * lanes_of(x)).collect::<Vec<_>>())
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
}
