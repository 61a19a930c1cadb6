//! Loads and stores, widening narrow elements (bf16, f16, quantised bytes) as they are
//! loaded, prefetches and stack or heap buffers.

use super::*;

impl<'c, 'a> Kb<'c, 'a> {
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
    /// A heap buffer (`memref.alloc`: `malloc` in the compiled library), for buffers too large
    /// for a thread's stack; freed with [`Kb::dealloc`] before the kernel returns.
    pub fn alloc(&self, ty: &str) -> Value<'c, 'a> {
        self.allocation("memref.alloc", ty)
    }

    pub fn dealloc(&self, mem: Value<'c, '_>) {
        self.op("memref.dealloc", &[mem], &[], &[]);
    }

    /// A statically shaped stack buffer of type `ty` (e.g. `memref<4x64xf32>`), 64-byte aligned,
    /// private to the calling thread and alive until the kernel returns.
    pub fn alloca(&self, ty: &str) -> Value<'c, 'a> {
        self.allocation("memref.alloca", ty)
    }

    /// A 64-byte-aligned buffer of memref type `ty` from `memref.alloc` or `memref.alloca`.
    fn allocation(&self, op: &str, ty: &str) -> Value<'c, 'a> {
        let ty = self.ty(ty);
        self.op(
            op,
            &[],
            &[ty],
            &[
                ("alignment", self.attr("64 : i64")),
                ("operandSegmentSizes", self.attr("array<i32: 0, 0>")),
            ],
        )[0]
    }

    /// Stores a scalar or a vector.
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
}
