//! The kernel catalogue: every distinct function a compiled library exports.
//!
//! A [`Kernel`] names one computation for one exact shape. The compiler emits one function per
//! distinct value (layers with equal shapes share it; weights are arguments), and the runtime
//! binds the same values by [`Kernel::symbol`]. Argument order is part of the ABI and is listed
//! on each variant; see [`crate::abi`] for the calling convention.

use crate::dtype::DType;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// An f32 stored by its bits, so kernels holding constants can be compared and hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct F32Bits(pub u32);

impl F32Bits {
    pub fn new(v: f32) -> Self {
        F32Bits(v.to_bits())
    }
    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

/// Per-head RMSNorm applied to q and k before RoPE (Qwen3).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QkNorm {
    pub q_dtype: DType,
    pub k_dtype: DType,
    pub eps: F32Bits,
}

/// The RMSNorm of a decode row folded into the matmul that consumes it: every thread
/// normalises the row into its own stack buffer before its share of the weight rows, with the
/// instructions of the [`Kernel::RmsNorm`] kernel (so the values are bitwise those prefill
/// computes), and the barrier a separate norm step would need disappears.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RowNorm {
    pub eps: F32Bits,
    pub wdtype: DType,
}

/// One kernel instance. `max_rows` is the static row capacity of the activation buffers it
/// touches: the prefill block size, or 1 for the decode specialisation. The actual row count
/// (`rows <= max_rows`) and the position of the first row (`pos`) are run-time arguments.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum Kernel {
    /// `x[r, :] = float(table[tokens[r], :])`.
    /// Args: `tokens: i32[max_rows]`, `table: dtype[vocab, hidden]`, `x: f32[max_rows, hidden]`.
    Embed {
        vocab: usize,
        hidden: usize,
        dtype: DType,
        max_rows: usize,
    },
    /// `y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w`.
    /// Args: `x: f32[max_rows, dim]`, `w: wdtype[dim]`, `y: f32[max_rows, dim]`.
    RmsNorm {
        dim: usize,
        eps: F32Bits,
        wdtype: DType,
        max_rows: usize,
    },
    /// `y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n])`, or `y += ...` when `accumulate`
    /// (the residual add fused into the epilogue). With `norm` (decode only), `x` is first
    /// replaced by its RMSNorm with weight `norm_w`.
    /// Args: `x: f32[max_rows, k]`, `w: wdtype[n, k]`, `y: f32[max_rows, n]`, then
    /// `bias: bdtype[n]` if `bias`, then `norm_w: [k]` if `norm`.
    MatMul {
        n: usize,
        k: usize,
        wdtype: DType,
        bias: Option<DType>,
        accumulate: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        norm: Option<RowNorm>,
        max_rows: usize,
    },
    /// Decode's whole MLP input side in one step: `g = x @ w_gate^T`, `u = x @ w_up^T`, then
    /// `g = silu(g) * u`, each thread finishing the outputs it computed (no barrier between
    /// the projections and the activation), with `norm` as in [`Kernel::MatMul`].
    /// Args: `x: f32[1, k]`, `w_gate: gate_dtype[n, k]`, `g: f32[1, n]`, `w_up: up_dtype[n, k]`,
    /// `u: f32[1, n]`, then `norm_w: [k]` if `norm`.
    GateUp {
        n: usize,
        k: usize,
        gate_dtype: DType,
        up_dtype: DType,
        norm: Option<RowNorm>,
        max_rows: usize,
    },
    /// For each row `r` at absolute position `pos + r`: optional per-head RMSNorm of q and k,
    /// RoPE (rotate-half) on q and k in place, then k and v written into the caches at row
    /// `pos + r`.
    /// Args: `q: f32[max_rows, heads*head_dim]`, `k, v: f32[max_rows, kv_heads*head_dim]`,
    /// `k_cache, v_cache: f32[kv_heads, ctx, head_dim]` (head-major: each head's keys are one
    /// contiguous stream for attention), `q_norm, k_norm: [head_dim]` (Qwen3).
    RopeKv {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        /// `head_dim / 2` inverse frequencies, f32 bits.
        inv_freq: Vec<u32>,
        qk_norm: Option<QkNorm>,
        ctx: usize,
        max_rows: usize,
    },
    /// Causal grouped-query attention of each row over cache rows `[start, pos + r]`, where
    /// `start = max(0, pos + r + 1 - window)` with a sliding window and 0 otherwise. Softmax in
    /// f32, scale `1 / sqrt(head_dim)`.
    /// Args: `q: f32[max_rows, heads*head_dim]`, `k_cache, v_cache: f32[kv_heads, ctx, head_dim]`,
    /// `out: f32[max_rows, heads*head_dim]`.
    Attention {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        ctx: usize,
        max_rows: usize,
    },
    /// `g[r, i] = silu(g[r, i]) * u[r, i]`, in place.
    /// Args: `g: f32[max_rows, dim]`, `u: f32[max_rows, dim]`.
    SiluMul { dim: usize, max_rows: usize },
    /// Machine probe: each thread reads its share of `buf` once, sequentially, with vector
    /// loads (the way decode streams weights) and writes a checksum to `sums[thread_id]`.
    /// Args: `buf: f32[elems]`, `sums: f32[64, 16]`. `rows` and `pos` are unused.
    ProbeRead { elems: usize },
    /// Machine probe: `rows` iterations of `chains` independent vector FMA chains held in
    /// registers, then a checksum to `sums[thread_id]`.
    /// Args: `sums: f32[64, 16]`.
    ProbeFma { chains: usize },
}

impl Kernel {
    /// The family name, used in symbols and in profiles.
    pub fn family(&self) -> &'static str {
        match self {
            Kernel::Embed { .. } => "embed",
            Kernel::RmsNorm { .. } => "rmsnorm",
            Kernel::MatMul { .. } => "matmul",
            Kernel::GateUp { .. } => "gate_up",
            Kernel::RopeKv { .. } => "rope_kv",
            Kernel::Attention { .. } => "attention",
            Kernel::SiluMul { .. } => "silu_mul",
            Kernel::ProbeRead { .. } => "probe_read",
            Kernel::ProbeFma { .. } => "probe_fma",
        }
    }

    pub fn max_rows(&self) -> usize {
        match self {
            Kernel::Embed { max_rows, .. }
            | Kernel::RmsNorm { max_rows, .. }
            | Kernel::MatMul { max_rows, .. }
            | Kernel::GateUp { max_rows, .. }
            | Kernel::RopeKv { max_rows, .. }
            | Kernel::Attention { max_rows, .. }
            | Kernel::SiluMul { max_rows, .. } => *max_rows,
            Kernel::ProbeRead { .. } | Kernel::ProbeFma { .. } => 1,
        }
    }

    /// Number of pointer arguments the kernel reads; the rest of the ABI's slots are unused.
    pub fn arg_count(&self) -> usize {
        match self {
            Kernel::Embed { .. } | Kernel::RmsNorm { .. } => 3,
            Kernel::MatMul { bias, norm, .. } => 3 + bias.is_some() as usize + norm.is_some() as usize,
            Kernel::GateUp { norm, .. } => 5 + norm.is_some() as usize,
            Kernel::RopeKv { qk_norm, .. } => 5 + 2 * qk_norm.is_some() as usize,
            Kernel::Attention { .. } => 4,
            Kernel::SiluMul { .. } | Kernel::ProbeRead { .. } => 2,
            Kernel::ProbeFma { .. } => 1,
        }
    }

    /// Indices of the pointer arguments the kernel writes (the others are only read).
    /// `accumulate` matmuls and in-place kernels also read what they write.
    pub fn written_args(&self) -> &'static [usize] {
        match self {
            Kernel::Embed { .. } | Kernel::RmsNorm { .. } | Kernel::MatMul { .. } => &[2],
            Kernel::GateUp { .. } => &[2, 4],
            Kernel::RopeKv { .. } => &[0, 1, 3, 4],
            Kernel::Attention { .. } => &[3],
            Kernel::SiluMul { .. } | Kernel::ProbeFma { .. } => &[0],
            Kernel::ProbeRead { .. } => &[1],
        }
    }

    /// Bytes the kernel reads and writes for one call on `rows` rows starting at position
    /// `pos`: weights once, activations per row, and for attention the cached keys and values
    /// each row attends to. An estimate for profiles (it ignores cache reuse between rows).
    pub fn bytes_moved(&self, rows: usize, pos: usize) -> u64 {
        let f = 4usize;
        let b = match self {
            Kernel::Embed { hidden, dtype, .. } => rows * (dtype.bytes_for(*hidden) + hidden * f + 4),
            Kernel::RmsNorm { dim, wdtype, .. } => wdtype.bytes_for(*dim) + rows * 2 * dim * f,
            Kernel::MatMul {
                n,
                k,
                wdtype,
                bias,
                accumulate,
                norm,
                ..
            } => {
                let out = if *accumulate { 2 } else { 1 };
                n * wdtype.bytes_for(*k)
                    + bias.map_or(0, |d| d.bytes_for(*n))
                    + norm.map_or(0, |nm| nm.wdtype.bytes_for(*k))
                    + rows * (k + out * n) * f
            }
            Kernel::GateUp {
                n,
                k,
                gate_dtype,
                up_dtype,
                norm,
                ..
            } => {
                n * (gate_dtype.bytes_for(*k) + up_dtype.bytes_for(*k))
                    + norm.map_or(0, |nm| nm.wdtype.bytes_for(*k))
                    + rows * (k + 3 * n) * f
            }
            Kernel::RopeKv {
                heads,
                kv_heads,
                head_dim,
                ..
            } => rows * (2 * heads + 6 * kv_heads) * head_dim * f,
            Kernel::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                ..
            } => {
                let keys = attended_keys(rows, pos, *window);
                rows * 2 * heads * head_dim * f + keys * 2 * kv_heads * head_dim * f
            }
            Kernel::SiluMul { dim, .. } => rows * 3 * dim * f,
            Kernel::ProbeRead { elems } => elems * f,
            Kernel::ProbeFma { .. } => 0,
        };
        b as u64
    }

    /// Floating-point operations of one call (a multiply-add counts 2), for profiles.
    pub fn flops(&self, rows: usize, pos: usize) -> u64 {
        let b = match self {
            Kernel::MatMul { n, k, .. } => 2 * rows * n * k,
            Kernel::GateUp { n, k, .. } => 4 * rows * n * k,
            Kernel::Attention {
                heads,
                head_dim,
                window,
                ..
            } => 4 * attended_keys(rows, pos, *window) * heads * head_dim,
            _ => 0,
        };
        b as u64
    }

    /// Exported symbol: readable shape fields plus a hash of the whole descriptor, so two
    /// kernels share a symbol exactly when they are equal.
    pub fn symbol(&self) -> String {
        let json = serde_json::to_string(self).expect("kernel descriptors serialise");
        let hash = Sha256::digest(json.as_bytes());
        let short: String = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
        let shape = match self {
            Kernel::Embed {
                vocab, hidden, dtype, ..
            } => format!("v{vocab}_h{hidden}_{dtype}"),
            Kernel::RmsNorm { dim, wdtype, .. } => format!("d{dim}_{wdtype}"),
            Kernel::MatMul {
                n,
                k,
                wdtype,
                bias,
                accumulate,
                norm,
                ..
            } => format!(
                "n{n}_k{k}_{wdtype}{}{}{}",
                if bias.is_some() { "_bias" } else { "" },
                if *accumulate { "_acc" } else { "" },
                if norm.is_some() { "_norm" } else { "" }
            ),
            Kernel::GateUp {
                n,
                k,
                gate_dtype,
                up_dtype,
                norm,
                ..
            } => format!(
                "n{n}_k{k}_{gate_dtype}_{up_dtype}{}",
                if norm.is_some() { "_norm" } else { "" }
            ),
            Kernel::RopeKv {
                heads,
                kv_heads,
                head_dim,
                qk_norm,
                ..
            } => format!(
                "h{heads}_kv{kv_heads}_d{head_dim}{}",
                if qk_norm.is_some() { "_qknorm" } else { "" }
            ),
            Kernel::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                ..
            } => format!(
                "h{heads}_kv{kv_heads}_d{head_dim}{}",
                window.map(|w| format!("_w{w}")).unwrap_or_default()
            ),
            Kernel::SiluMul { dim, .. } => format!("d{dim}"),
            Kernel::ProbeRead { elems } => format!("e{elems}"),
            Kernel::ProbeFma { chains } => format!("c{chains}"),
        };
        let regime = if self.max_rows() == 1 {
            "decode".to_string()
        } else {
            format!("r{}", self.max_rows())
        };
        format!("kiln_{}_{shape}_{regime}_{short}", self.family())
    }
}

/// Cache rows the attention of `rows` rows starting at `pos` reads, summed over the rows (each
/// row `r` attends to positions up to `pos + r`, within the sliding window if there is one).
fn attended_keys(rows: usize, pos: usize, window: Option<usize>) -> usize {
    (0..rows)
        .map(|r| window.map_or(pos + r + 1, |w| (pos + r + 1).min(w)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_differ_exactly_when_kernels_differ() {
        let a = Kernel::SiluMul { dim: 128, max_rows: 64 };
        let b = Kernel::SiluMul { dim: 128, max_rows: 1 };
        let c = Kernel::SiluMul { dim: 128, max_rows: 64 };
        assert_ne!(a.symbol(), b.symbol());
        assert_eq!(a.symbol(), c.symbol());
        assert!(b.symbol().starts_with("kiln_silu_mul_d128_decode_"));
    }
}
