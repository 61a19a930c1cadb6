//! Integer vector operations of `--precision q8` (see `emit/quant8.rs`): 8-bit codes and
//! activations multiplied in pairs into 16-bit and 32-bit sums with AVX2's `vpmaddubsw` and
//! `vpmaddwd`, and the rounding that makes the 8-bit activations.
//!
//! They are LLVM intrinsics of 256-bit AVX2 instructions, which every x86 level Kiln compiles
//! for with `--precision q8` has (x86-64-v3 and up, AVX-512 machines included).

use super::{Kb, lanes_of};
use melior::ir::Value;

impl<'c, 'a> Kb<'c, 'a> {
    /// `vpmaddubsw`: i16 lane `i` is `u[2i] * s[2i] + u[2i + 1] * s[2i + 1]`, `u`'s bytes read
    /// as unsigned, `s`'s as signed, the sum saturated to i16 (callers keep it in range). 32
    /// bytes each (AVX2), or 64 (AVX512-BW).
    pub fn madd_u8_i8(&self, u: Value<'c, '_>, s: Value<'c, '_>) -> Value<'c, 'a> {
        match lanes_of(u) {
            64 => self.intrinsic("llvm.x86.avx512.pmaddubs.w.512", &[u, s], self.vec_ty(32, "i16")),
            _ => self.intrinsic("llvm.x86.avx2.pmadd.ub.sw", &[u, s], self.vec_ty(16, "i16")),
        }
    }

    /// `vpmaddwd`: i32 lane `i` is `a[2i] * b[2i] + a[2i + 1] * b[2i + 1]`: 16 i16 lanes each
    /// (AVX2), or 32 (AVX512-BW).
    pub fn madd_i16(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        match lanes_of(a) {
            32 => self.intrinsic("llvm.x86.avx512.pmaddw.d.512", &[a, b], self.vec_ty(16, "i32")),
            _ => self.intrinsic("llvm.x86.avx2.pmadd.wd", &[a, b], self.vec_ty(8, "i32")),
        }
    }

    /// `vpdpbusd` (AVX-VNNI, or AVX512-VNNI with VL): i32 lane `i` of `acc` plus the four
    /// products `u[4i + j] * s[4i + j]` (`u`'s bytes unsigned, `s`'s signed), without the
    /// intermediate i16 saturation of `vpmaddubsw`. LLVM 22 declares its operands as bytes
    /// (`<32 x i8>`; earlier versions as `<8 x i32>`).
    /// 32 bytes each (AVX-VNNI, AVX512-VNNI with VL), or 64 (AVX512-VNNI).
    pub fn dot_u8_i8(&self, acc: Value<'c, '_>, u: Value<'c, '_>, s: Value<'c, '_>) -> Value<'c, 'a> {
        match lanes_of(u) {
            64 => self.intrinsic("llvm.x86.avx512.vpdpbusd.512", &[acc, u, s], self.vec_ty(16, "i32")),
            _ => self.intrinsic("llvm.x86.avx512.vpdpbusd.256", &[acc, u, s], self.vec_ty(8, "i32")),
        }
    }

    /// `vpsignb`: each byte of `a` negated where `b`'s is negative, zeroed where it is zero.
    pub fn sign_bytes(&self, a: Value<'c, '_>, b: Value<'c, '_>) -> Value<'c, 'a> {
        self.intrinsic("llvm.x86.avx2.psign.b", &[a, b], self.vec_ty(32, "i8"))
    }

    /// `vcvtps2dq`: 8 f32 lanes to i32, rounded to nearest even (the default rounding mode).
    pub fn round_to_i32(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        self.intrinsic("llvm.x86.avx.cvt.ps2dq.256", &[v], self.vec_ty(8, "i32"))
    }

    /// Integer lanes narrowed to `elem` (the low bits kept).
    pub fn trunci(&self, v: Value<'c, '_>, elem: &str) -> Value<'c, 'a> {
        self.op1("arith.trunci", &[v], self.retyped(v, elem), &[])
    }

    /// The sum of an integer vector's lanes (wrapping; callers keep it in range).
    pub fn reduce_add_int(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        let elem = self.ty(&super::elem_of(v));
        self.op1(
            "vector.reduction",
            &[v],
            elem,
            &[("kind", self.attr("#vector.kind<add>"))],
        )
    }

    /// `|v|` of f32 lanes, by clearing the sign bits.
    pub fn abs_f32(&self, v: Value<'c, '_>) -> Value<'c, 'a> {
        let bits = self.bitcast(v, "i32");
        let mask = self.int_splat(0x7fff_ffff, lanes_of(v), "i32");
        self.bitcast(self.andi(bits, mask), "f32")
    }
}
