//! The computation of one forward pass as an ordered list of kernel calls.
//!
//! Both sides read this one description: the compiler emits the distinct kernels it names, the
//! runtime binds their symbols and resolves each argument to a pointer. Barriers are derived here
//! from the data each step reads and writes, so the runtime never has to guess which steps may
//! overlap.

use crate::kernel::{F32Bits, Kernel, QkNorm, RowNorm};
use crate::model::ModelSpec;
use crate::weights::{LayerWeight, WeightId};
use std::collections::BTreeSet;

/// Activation buffers and caches owned by the runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// Token ids of the block, i32.
    Tokens,
    /// Residual stream, `[rows, hidden]`.
    X,
    /// Normalised residual, `[rows, hidden]`.
    Xn,
    Q,
    K,
    V,
    /// Attention output, `[rows, heads * head_dim]`.
    Attn,
    /// MLP gate projection; holds `silu(gate) * up` after the elementwise step.
    Gate,
    Up,
    /// Output logits of one row, `[1, vocab]`.
    Logits,
    KCache(usize),
    VCache(usize),
}

impl Buf {
    /// Elements (f32, or i32 for tokens) per row of this buffer.
    pub fn row_len(self, spec: &ModelSpec) -> usize {
        match self {
            Buf::Tokens => 1,
            Buf::X | Buf::Xn => spec.hidden_size,
            Buf::Q | Buf::Attn => spec.q_dim(),
            Buf::K | Buf::V | Buf::KCache(_) | Buf::VCache(_) => spec.kv_dim(),
            Buf::Gate | Buf::Up => spec.intermediate_size,
            Buf::Logits => spec.vocab_size,
        }
    }
}

/// Where a kernel's pointer argument comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// Row 0 of a buffer.
    Buf(Buf),
    /// Row `rows - 1` of a buffer (the output head reads only the last position of a block).
    LastRow(Buf),
    Weight(WeightId),
}

impl Arg {
    fn buf(self) -> Option<Buf> {
        match self {
            Arg::Buf(b) | Arg::LastRow(b) => Some(b),
            Arg::Weight(_) => None,
        }
    }
}

/// One kernel call. `barrier_before` is true when this step touches data that a step since the
/// last barrier wrote (or reads data this step overwrites), so all threads must finish first.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub kernel: Kernel,
    pub args: Vec<Arg>,
    pub barrier_before: bool,
    /// Layer index, or `None` for embedding and head; used by profiles.
    pub layer: Option<usize>,
}

/// An ordered list of steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub steps: Vec<Step>,
}

impl Graph {
    fn push(&mut self, kernel: Kernel, args: Vec<Arg>, layer: Option<usize>) {
        assert_eq!(
            kernel.arg_count(),
            args.len(),
            "{} takes {} pointer arguments",
            kernel.family(),
            kernel.arg_count()
        );
        self.steps.push(Step {
            kernel,
            args,
            barrier_before: false,
            layer,
        });
    }

    /// Marks the barriers from each step's read and write sets (RAW, WAR and WAW hazards on
    /// buffers). Weights are never written, so they never force a barrier.
    fn place_barriers(&mut self) {
        let mut written: BTreeSet<Buf> = BTreeSet::new();
        let mut read: BTreeSet<Buf> = BTreeSet::new();
        for step in &mut self.steps {
            let writes: BTreeSet<Buf> = step
                .kernel
                .written_args()
                .iter()
                .filter_map(|&i| step.args[i].buf())
                .collect();
            let reads: BTreeSet<Buf> = step.args.iter().filter_map(|a| a.buf()).collect();
            let hazard = reads.iter().any(|b| written.contains(b))
                || writes.iter().any(|b| read.contains(b) || written.contains(b));
            if hazard {
                step.barrier_before = true;
                written.clear();
                read.clear();
            }
            written.extend(writes);
            read.extend(reads);
        }
    }

    /// Number of barriers a run of this graph executes (the implicit one at the end included).
    pub fn barrier_count(&self) -> usize {
        self.steps.iter().filter(|s| s.barrier_before).count() + 1
    }
}

/// Embedding and every decoder layer for a block of up to `max_rows` tokens, ending with the
/// residual stream in [`Buf::X`].
pub fn block_graph(spec: &ModelSpec, max_rows: usize) -> Graph {
    let mut g = Graph::default();
    // The caches' static capacity is the model's own limit: they are head-major
    // (`[kv_heads, capacity, head_dim]`, each head's keys one contiguous stream), so the runtime
    // reserves that much address space, uses the first `ctx` positions of each head, and checks
    // every position against `ctx` before calling a kernel.
    let ctx = spec.max_position_embeddings;
    let h = spec.hidden_size;
    let eps = F32Bits::new(spec.rms_norm_eps);
    g.push(
        Kernel::Embed {
            vocab: spec.vocab_size,
            hidden: h,
            dtype: spec.embed_dtype,
            max_rows,
        },
        vec![Arg::Buf(Buf::Tokens), Arg::Weight(WeightId::Embed), Arg::Buf(Buf::X)],
        None,
    );
    let inv_freq: Vec<u32> = spec.rope.inv_freq(spec.head_dim).iter().map(|f| f.to_bits()).collect();
    for (l, layer) in spec.layers.iter().enumerate() {
        let d = &layer.dtypes;
        let w = |lw| Arg::Weight(WeightId::Layer(l, lw));
        let at = Some(l);
        // Decode folds each RMSNorm into the matmuls that read it (every thread normalises the
        // one row itself): two barriers and two steps fewer per layer. Prefill keeps the norm
        // as a step, since there each thread would otherwise normalise every row of the block.
        let fuse_norms = max_rows == 1;
        let attn_norm = fuse_norms.then_some(RowNorm {
            eps,
            wdtype: d.attn_norm,
        });
        let input = if fuse_norms { Buf::X } else { Buf::Xn };
        if !fuse_norms {
            g.push(
                Kernel::RmsNorm {
                    dim: h,
                    eps,
                    wdtype: d.attn_norm,
                    max_rows,
                },
                vec![Arg::Buf(Buf::X), w(LayerWeight::AttnNorm), Arg::Buf(Buf::Xn)],
                at,
            );
        }
        let projections = [
            (LayerWeight::Q, LayerWeight::QBias, spec.q_dim(), d.q, d.q_bias, Buf::Q),
            (LayerWeight::K, LayerWeight::KBias, spec.kv_dim(), d.k, d.k_bias, Buf::K),
            (LayerWeight::V, LayerWeight::VBias, spec.kv_dim(), d.v, d.v_bias, Buf::V),
        ];
        for (lw, lb, n, wdtype, bias, out) in projections {
            let mut args = vec![Arg::Buf(input), w(lw), Arg::Buf(out)];
            if bias.is_some() {
                args.push(w(lb));
            }
            if attn_norm.is_some() {
                args.push(w(LayerWeight::AttnNorm));
            }
            g.push(
                Kernel::MatMul {
                    n,
                    k: h,
                    wdtype,
                    bias,
                    accumulate: false,
                    norm: attn_norm,
                    max_rows,
                },
                args,
                at,
            );
        }
        let qk_norm = match (d.q_norm, d.k_norm) {
            (Some(q_dtype), Some(k_dtype)) => Some(QkNorm { q_dtype, k_dtype, eps }),
            _ => None,
        };
        let mut args = vec![
            Arg::Buf(Buf::Q),
            Arg::Buf(Buf::K),
            Arg::Buf(Buf::V),
            Arg::Buf(Buf::KCache(l)),
            Arg::Buf(Buf::VCache(l)),
        ];
        if qk_norm.is_some() {
            args.push(w(LayerWeight::QNorm));
            args.push(w(LayerWeight::KNorm));
        }
        g.push(
            Kernel::RopeKv {
                heads: spec.num_heads,
                kv_heads: spec.num_kv_heads,
                head_dim: spec.head_dim,
                inv_freq: inv_freq.clone(),
                qk_norm,
                ctx,
                max_rows,
            },
            args,
            at,
        );
        g.push(
            Kernel::Attention {
                heads: spec.num_heads,
                kv_heads: spec.num_kv_heads,
                head_dim: spec.head_dim,
                window: layer.sliding_window,
                ctx,
                max_rows,
            },
            vec![
                Arg::Buf(Buf::Q),
                Arg::Buf(Buf::KCache(l)),
                Arg::Buf(Buf::VCache(l)),
                Arg::Buf(Buf::Attn),
            ],
            at,
        );
        let mut args = vec![Arg::Buf(Buf::Attn), w(LayerWeight::O), Arg::Buf(Buf::X)];
        if d.o_bias.is_some() {
            args.push(w(LayerWeight::OBias));
        }
        g.push(
            Kernel::MatMul {
                n: h,
                k: spec.q_dim(),
                wdtype: d.o,
                bias: d.o_bias,
                accumulate: true,
                norm: None,
                max_rows,
            },
            args,
            at,
        );
        let i = spec.intermediate_size;
        if fuse_norms {
            g.push(
                Kernel::GateUp {
                    n: i,
                    k: h,
                    gate_dtype: d.gate,
                    up_dtype: d.up,
                    norm: Some(RowNorm {
                        eps,
                        wdtype: d.mlp_norm,
                    }),
                    max_rows,
                },
                vec![
                    Arg::Buf(Buf::X),
                    w(LayerWeight::Gate),
                    Arg::Buf(Buf::Gate),
                    w(LayerWeight::Up),
                    Arg::Buf(Buf::Up),
                    w(LayerWeight::MlpNorm),
                ],
                at,
            );
        } else {
            g.push(
                Kernel::RmsNorm {
                    dim: h,
                    eps,
                    wdtype: d.mlp_norm,
                    max_rows,
                },
                vec![Arg::Buf(Buf::X), w(LayerWeight::MlpNorm), Arg::Buf(Buf::Xn)],
                at,
            );
            for (lw, wdtype, out) in [(LayerWeight::Gate, d.gate, Buf::Gate), (LayerWeight::Up, d.up, Buf::Up)] {
                g.push(
                    Kernel::MatMul {
                        n: i,
                        k: h,
                        wdtype,
                        bias: None,
                        accumulate: false,
                        norm: None,
                        max_rows,
                    },
                    vec![Arg::Buf(Buf::Xn), w(lw), Arg::Buf(out)],
                    at,
                );
            }
            g.push(
                Kernel::SiluMul { dim: i, max_rows },
                vec![Arg::Buf(Buf::Gate), Arg::Buf(Buf::Up)],
                at,
            );
        }
        g.push(
            Kernel::MatMul {
                n: h,
                k: i,
                wdtype: d.down,
                bias: None,
                accumulate: true,
                norm: None,
                max_rows,
            },
            vec![Arg::Buf(Buf::Gate), w(LayerWeight::Down), Arg::Buf(Buf::X)],
            at,
        );
    }
    g.place_barriers();
    g
}

/// Final norm and output head on the last row of the residual stream, into [`Buf::Logits`].
/// Runs with `rows` = the rows of the block just computed; its kernels are decode kernels.
pub fn head_graph(spec: &ModelSpec) -> Graph {
    let mut g = Graph::default();
    let h = spec.hidden_size;
    let (head, dtype) = if spec.tie_word_embeddings {
        (WeightId::Embed, spec.embed_dtype)
    } else {
        (WeightId::LmHead, spec.lm_head_dtype)
    };
    // The final norm is folded into the head matmul (each thread normalises the row itself).
    g.push(
        Kernel::MatMul {
            n: spec.vocab_size,
            k: h,
            wdtype: dtype,
            bias: None,
            accumulate: false,
            norm: Some(RowNorm {
                eps: F32Bits::new(spec.rms_norm_eps),
                wdtype: spec.final_norm_dtype,
            }),
            max_rows: 1,
        },
        vec![
            Arg::LastRow(Buf::X),
            Arg::Weight(head),
            Arg::Buf(Buf::Logits),
            Arg::Weight(WeightId::FinalNorm),
        ],
        None,
    );
    // The head always follows a block whose last step wrote X from other threads.
    g.place_barriers();
    if let Some(first) = g.steps.first_mut() {
        first.barrier_before = true;
    }
    g
}

/// Every distinct kernel a library for this spec must export, in first-use order.
pub fn kernel_set(spec: &ModelSpec, prefill_rows: usize) -> Vec<Kernel> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let graphs = [block_graph(spec, prefill_rows), block_graph(spec, 1), head_graph(spec)];
    for step in graphs.iter().flat_map(|g| g.steps.iter()) {
        if seen.insert(step.kernel.clone()) {
            out.push(step.kernel.clone());
        }
    }
    out
}
