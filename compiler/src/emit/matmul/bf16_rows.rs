//! `--precision bf16`'s activation operand: the rows of a call rounded to bf16 once, from
//! which the quad-order pairs ([`super::quad`]) broadcast their pieces.

use crate::emit::Dyn;
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// Largest copy of the activation rows rounded to bf16 ([`bf16_rows`]) a kernel keeps on its
/// stack (the calling thread's stack is the process's main one); larger ones (long prefill
/// blocks over wide rows) go to the heap.
const BF16_ROWS_STACK_BYTES: usize = 4 << 20;

/// The activation rows of a call rounded to bf16 ([`bf16_rows`]).
#[derive(Clone, Copy)]
pub(in crate::emit) struct Bf16Rows<'c, 'a> {
    /// `memref<max_rows x k x bf16>`.
    pub(in crate::emit) buf: Value<'c, 'a>,
    heap: bool,
}

impl Bf16Rows<'_, '_> {
    /// Frees the buffer if it is on the heap: emitted after the kernel's last use of it.
    pub(in crate::emit) fn release(&self, b: Kb<'_, '_>) {
        if self.heap {
            b.dealloc(self.buf);
        }
    }
}

/// `--precision bf16`: rows `0..d.rows` of `x` rounded to bf16 (to nearest even) into a
/// buffer `memref<max_rows x k x bf16>`, once per call and thread, when the pairs apply to
/// one of `dtypes` ([`super::MatMul::pairs`]'s conditions). Rounding as they load would cost a
/// conversion and a shuffle per activation piece in every tile of every block; from the
/// buffer each piece is one broadcast load.
#[allow(clippy::too_many_arguments)]
pub(in crate::emit) fn bf16_rows<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    x: Value<'c, '_>,
    dtypes: &[DType],
    k: usize,
    max_rows: usize,
    lanes: usize,
    opts: &kiln_core::CompileOptions,
) -> Option<Bf16Rows<'c, 'a>> {
    let applies = opts.precision == kiln_core::Precision::Bf16
        && dtypes.contains(&DType::BF16)
        && lanes == 16
        && k.is_multiple_of(super::PAIR_STEP);
    if !applies {
        return None;
    }
    let ty = format!("memref<{max_rows}x{k}xbf16>");
    let heap = max_rows * k * 2 > BF16_ROWS_STACK_BYTES;
    let xr = if heap { b.alloc(&ty) } else { b.alloca(&ty) };
    let step = super::PAIR_STEP;
    b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
        b.for_each(b.idx(0), b.idx(k), b.idx(step), |b, kk| {
            b.store(b.load_as_bf16(x, &[r, kk], step), xr, &[r, kk])
        });
    });
    Some(Bf16Rows { buf: xr, heap })
}
