//! Kiln against Hugging Face `transformers` in float32: every committed fixture model (Llama,
//! Mistral with a sliding window, Qwen2 with biases and tied embeddings, Qwen3 with q/k norms)
//! is compiled, and for every golden prompt the greedy continuation must be token-for-token
//! identical and the last-position logits within 1e-3.
//!
//! Goldens come from `scripts/make_golden.py`; nothing here uses the network or `../shared`.

// Test diagnostics go to the harness's stderr; clippy.toml bans the print macros for the CLI.
#![allow(clippy::disallowed_macros)]

use kiln::session::{OpenOptions, Session};
use kiln_text::sampler::argmax;
use serde::Deserialize;

#[path = "common/goldens.rs"]
mod goldens;
use goldens::{assert_split_agree, cache_dir, fixture, golden, longrope_original, max_abs_diff, models};

const LOGIT_TOLERANCE: f32 = 1e-3;

fn open(name: &str, threads: usize, prefill_rows: Option<usize>) -> Session {
    open_with(name, threads, prefill_rows, None)
}

fn open_with(name: &str, threads: usize, prefill_rows: Option<usize>, max_f32_lanes: Option<usize>) -> Session {
    open_opts(
        name,
        OpenOptions {
            threads: Some(threads),
            prefill_rows,
            max_f32_lanes,
            ..OpenOptions::default()
        },
    )
}

fn open_opts(name: &str, opts: OpenOptions) -> Session {
    let opts = OpenOptions {
        cache_dir: Some(cache_dir().to_path_buf()),
        ..opts
    };
    Session::open(&fixture(name), &opts).unwrap_or_else(|e| panic!("opening {name}: {e:#}"))
}

/// Greedy continuation of `n` tokens, ignoring EOS (as the goldens were recorded).
fn greedy(session: &mut Session, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    session.engine.reset();
    let first_logits = session.engine.prefill(prompt).expect("prefill").to_vec();
    let mut out = vec![argmax(&first_logits) as u32];
    while out.len() < n {
        let logits = session.engine.decode(*out.last().unwrap()).expect("decode");
        out.push(argmax(logits) as u32);
    }
    (out, first_logits)
}

/// Checks every case of `name`; returns the largest logit difference seen.
fn check_model(name: &str, threads: usize, prefill_rows: Option<usize>) -> f32 {
    check_model_with(name, threads, prefill_rows, None)
}

fn check_model_with(name: &str, threads: usize, prefill_rows: Option<usize>, lanes: Option<usize>) -> f32 {
    let session = open_with(name, threads, prefill_rows, lanes);
    let what = format!(
        "threads {threads}, prefill block {prefill_rows:?}, f32 lanes {}",
        lanes.map_or("of the host".to_string(), |l| format!("<= {l}"))
    );
    check_session(name, session, &what)
}

fn check_session(name: &str, mut session: Session, what: &str) -> f32 {
    let mut worst = 0.0f32;
    for (i, case) in golden(name).cases.iter().enumerate() {
        let ids = session.tokenizer.encode(&case.prompt, true).expect("encode");
        assert_eq!(
            ids, case.prompt_token_ids,
            "{name} case {i}: tokenisation differs from transformers"
        );
        let (tokens, logits) = greedy(&mut session, &ids, case.greedy_token_ids.len());
        let diff = max_abs_diff(&logits, &case.last_logits);
        worst = worst.max(diff);
        assert!(
            diff <= LOGIT_TOLERANCE,
            "{name} case {i}: last-position logits differ by {diff} (> {LOGIT_TOLERANCE})"
        );
        assert_eq!(
            tokens, case.greedy_token_ids,
            "{name} case {i}: greedy continuation differs from transformers"
        );
    }
    eprintln!("{name} ({what}): max |logit diff| = {worst:e}");
    worst
}

#[test]
fn greedy_output_and_logits_match_transformers() {
    for name in models() {
        check_model(&name, 2, None);
    }
}

#[test]
fn narrower_vectors_match_transformers_too() {
    // The code an AVX2 (8 lanes) or SSE-width (4 lanes) machine gets: other row groupings,
    // tiles and reduction trees, checked on whatever machine runs the tests.
    for lanes in [8, 4] {
        for name in ["llama", "qwen3", "gemma2", "qwen3_5"] {
            check_model_with(name, 2, None, Some(lanes));
        }
    }
}

#[test]
fn avx2_level_code_matches_transformers_too() {
    // Built for x86-64-v3 (AVX2 + FMA) rather than this CPU, the library is what an AVX2-only
    // machine runs: 16 vector registers, no AVX-512 instructions, LLVM's own instruction
    // selection for that level. Checked wherever the tests run on a CPU that has the level.
    let host = kiln_core::HostCpu::detect();
    if let Err(why) = host.x86_level("x86-64-v3") {
        eprintln!("skipped: {why}");
        return;
    }
    let asm = tempfile::tempdir().expect("asm dir");
    for name in [
        "llama",
        "qwen2",
        "qwen3",
        "phi3-longrope",
        "gpt2",
        "phi",
        "gemma2",
        "gemma3",
        "qwen3_5",
    ] {
        let session = open_opts(
            name,
            OpenOptions {
                threads: Some(2),
                target_cpu: Some("x86-64-v3".into()),
                emit_asm: Some(asm.path().to_path_buf()),
                ..OpenOptions::default()
            },
        );
        check_session(name, session, "built for x86-64-v3");
    }
    let mut files = 0;
    for entry in std::fs::read_dir(asm.path()).expect("asm written") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("asm readable");
        assert!(
            !text.contains("%zmm") && !text.contains("%k1"),
            "{} uses AVX-512 registers in code built for x86-64-v3",
            path.display()
        );
        files += 1;
    }
    assert!(files > 10, "expected the kernels' assembly, found {files} files");
}

#[test]
fn long_prompt_spans_many_small_prefill_blocks() {
    // The long golden prompt has ~270 tokens: with 8-row blocks that is 34 blocks and a
    // partial one, exercising block boundaries, the sliding window across blocks and the
    // head reading the last row of a partial block.
    // phi3: its window across blocks; phi3-longrope: every block of one call takes the long
    // factors, chosen by the call's sequence end.
    // qwen3_5: the convolution's and the delta rule's state carried from block to block.
    for name in ["mistral", "qwen3", "phi3", "phi3-longrope", "gemma3", "qwen3_5"] {
        let long = golden(name)
            .cases
            .iter()
            .map(|c| c.prompt_token_ids.len())
            .max()
            .unwrap();
        assert!(
            long > 64 * 4,
            "{name}: the golden set needs a prompt longer than several default blocks"
        );
        check_model(name, 2, Some(8));
    }
}

#[test]
fn single_thread_gives_bitwise_identical_logits() {
    // Threads only partition the work; every output is computed by the same instructions.
    for name in ["llama", "qwen2"] {
        let case = &golden(name).cases[1];
        let mut one = open(name, 1, None);
        let mut two = open(name, 2, None);
        let a = one.engine.prefill(&case.prompt_token_ids).unwrap().to_vec();
        let b = two.engine.prefill(&case.prompt_token_ids).unwrap().to_vec();
        assert_eq!(a, b, "{name}: logits depend on the thread count");
    }
}

#[test]
fn prefill_and_decode_agree_position_by_position() {
    for name in models() {
        let name = name.as_str();
        let case = golden(name)
            .cases
            .into_iter()
            .max_by_key(|c| c.prompt_token_ids.len())
            .unwrap();
        let ids = &case.prompt_token_ids;
        let mut session = open(name, 2, None);
        // Decode the whole prompt one token at a time after a one-token prefill, keeping the
        // logits at every position.
        let decoded = decode_after_prefill(&mut session, ids, 1);
        // LongRoPE takes its long factors once a call's sequence passes `original` positions,
        // and cached keys keep the rotation they were given (as transformers with a KV cache),
        // so past that point the prefill is compared with a decode that started from a prefill
        // already past it: both sides then rotate every key with the long factors.
        let long_from = longrope_original(&session.spec).filter(|&o| o + 1 < ids.len());
        let decoded_long = long_from.map(|o| decode_after_prefill(&mut session, ids, o + 1));
        let mut worst = 0.0f32;
        for t in [0, 1, 7, 63, 64, 65, 130, ids.len() - 1] {
            session.engine.reset();
            let prefilled = session.engine.prefill(&ids[..=t]).unwrap().to_vec();
            let reference = match (long_from, &decoded_long) {
                (Some(o), Some(long)) if t >= o => &long[t],
                _ => &decoded[t],
            };
            worst = worst.max(max_abs_diff(&prefilled, reference));
            // Every output is computed by the same arithmetic in both regimes (one accumulator
            // per output, the same k order and lane-summing tree), so they agree exactly; the
            // recurrent model's chunked prefill to rounding.
            let what = format!("{name}: position {t}: prefill and decode");
            assert_split_agree(&what, &session.spec, &prefilled, reference);
        }
        eprintln!("{name}: prefill vs decode max |diff| = {worst:e}");
    }
}

/// The logits at every position from `first - 1` on (earlier ones empty) of prefilling
/// `ids[..first]` and decoding the rest one token at a time.
fn decode_after_prefill(session: &mut Session, ids: &[u32], first: usize) -> Vec<Vec<f32>> {
    session.engine.reset();
    let mut out = vec![Vec::new(); first - 1];
    out.push(session.engine.prefill(&ids[..first]).unwrap().to_vec());
    for &t in &ids[first..] {
        out.push(session.engine.decode(t).unwrap().to_vec());
    }
    out
}

#[derive(Deserialize)]
struct Crossing {
    prompt_token_ids: Vec<u32>,
    original_max_position_embeddings: usize,
    greedy_token_ids: Vec<u32>,
    final_logits: Vec<f32>,
}

#[test]
fn longrope_crossing_while_decoding_matches_transformers_kv_cache() {
    // A sequence that passes LongRoPE's original context while decoding: the keys cached before
    // keep their short-factor rotation, later rows take the long factors, as transformers' KV
    // cache computes it (kv_cache_crossing.json, made by make_golden.py; recomputing everything
    // with the long factors would move those logits by ~15).
    let path = fixture("phi3-longrope").join("kv_cache_crossing.json");
    let c: Crossing = serde_json::from_str(&std::fs::read_to_string(path).expect("crossing json")).unwrap();
    let (ids, n) = (&c.prompt_token_ids, c.greedy_token_ids.len());
    assert!(ids.len() <= c.original_max_position_embeddings && ids.len() + n > c.original_max_position_embeddings);
    let mut session = open("phi3-longrope", 2, None);
    let (tokens, _) = greedy(&mut session, ids, n);
    assert_eq!(tokens, c.greedy_token_ids, "greedy tokens across the LongRoPE boundary");
    let last = session.engine.decode(*tokens.last().unwrap()).unwrap().to_vec();
    let diff = max_abs_diff(&last, &c.final_logits);
    eprintln!("phi3-longrope crossing at decode: final-step max |logit diff| = {diff:e}");
    assert!(diff <= LOGIT_TOLERANCE, "logits after crossing differ by {diff}");
}

/// Each prompt alone in slot 0: its prefill logits, then those of `steps` greedy decode steps.
fn alone_logits(session: &mut Session, prompts: &[Vec<u32>], steps: usize) -> Vec<Vec<Vec<f32>>> {
    prompts
        .iter()
        .map(|p| {
            let e = &mut session.engine;
            e.reset();
            let mut logits = vec![e.prefill(p).expect("prefill").to_vec()];
            for _ in 0..steps {
                let next = argmax(logits.last().unwrap()) as u32;
                logits.push(e.decode(next).expect("decode").to_vec());
            }
            logits
        })
        .collect()
}

/// Continuous batching's contract: a sequence's logits are bitwise the same whether its
/// decode step runs alone or in one batched step with other sequences (each in its own KV
/// slot, at its own position), on every fixture (learned positions, sliding windows, LongRoPE,
/// soft caps). Three sequences of different lengths decode together; each is compared with
/// the same sequence decoded alone in slot 0.
#[test]
fn batched_decode_equals_each_sequence_alone() {
    // The host's code, and the AVX2 level's (16 registers: smaller tiles of rows).
    let mut targets = vec![None];
    if kiln_core::HostCpu::detect().x86_level("x86-64-v3").is_ok() {
        targets.push(Some("x86-64-v3".to_string()));
    }
    for (name, target_cpu) in models()
        .into_iter()
        .flat_map(|m| targets.iter().map(move |t| (m.clone(), t.clone())))
    {
        let mut session = open_opts(
            &name,
            OpenOptions {
                threads: Some(2),
                slots: 3,
                target_cpu,
                ..OpenOptions::default()
            },
        );
        let cases = golden(&name).cases;
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                let ids = &cases[i % cases.len()].prompt_token_ids;
                // Different lengths, so the rows sit at different positions.
                ids[..ids.len().saturating_sub(i).max(1)].to_vec()
            })
            .collect();
        let steps = 6;
        let alone = alone_logits(&mut session, &prompts, steps);
        // Together: each prompt in its own slot, then every decode step batched.
        let e = &mut session.engine;
        let vocab = e.spec().dims.vocab_size;
        let mut last: Vec<Vec<f32>> = Vec::new();
        for (slot, p) in prompts.iter().enumerate() {
            e.truncate_in(slot, 0);
            last.push(e.prefill_in(slot, p).expect("prefill").to_vec());
            assert_eq!(last[slot], alone[slot][0], "{name}: prefill in slot {slot}");
        }
        for step in 1..=steps {
            let batch: Vec<(usize, u32)> = (0..3).map(|s| (s, argmax(&last[s]) as u32)).collect();
            let logits = e.decode_batch(&batch).expect("batched decode");
            for ((s, row), seq) in logits.chunks(vocab).enumerate().zip(&alone) {
                assert!(
                    row == &seq[step][..],
                    "{name}: step {step}, sequence {s}: batched logits differ from decoding it alone"
                );
                last[s] = row.to_vec();
            }
        }
    }
}

/// Continuous batching with chunked prefill: forward steps that mix decoding sequences with
/// chunks of other sequences' prompts (in decode-sized blocks and in prefill-sized ones) give
/// every sequence bitwise the logits it gets alone.
#[test]
fn mixed_steps_equal_each_sequence_alone() {
    use kiln_engine::engine::StepPart;
    for name in models() {
        let mut session = open_opts(
            &name,
            OpenOptions {
                threads: Some(2),
                slots: 3,
                ..OpenOptions::default()
            },
        );
        let cases = golden(&name).cases;
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| {
                let mut ids = cases[i % cases.len()].prompt_token_ids.clone();
                ids.extend_from_slice(&cases[(i + 1) % cases.len()].prompt_token_ids);
                ids
            })
            .collect();
        let steps = 5;
        let alone = alone_logits(&mut session, &prompts, steps);
        // Chunks of 2 prompt tokens keep steps within the decode kernels' rows; chunks of 20
        // beside decoding rows take the prefill kernels (at most 62 rows of the 64-row block).
        for chunk in [2, 20] {
            let e = &mut session.engine;
            let vocab = e.spec().dims.vocab_size;
            // Per sequence: prompt tokens prefilled, logits seen so far.
            let mut done = [0usize; 3];
            let mut seen: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
            for s in 0..3 {
                e.truncate_in(s, 0);
            }
            let mut turn = 0;
            while seen.iter().any(|l| l.len() <= steps) {
                let mut tokens: Vec<Vec<u32>> = Vec::new();
                let mut who = Vec::new();
                // Sequence s starts at turn s; decoding ones feed their greedy token.
                for s in (0..3).filter(|&s| s <= turn && seen[s].len() <= steps) {
                    if done[s] < prompts[s].len() {
                        let end = prompts[s].len().min(done[s].saturating_add(chunk));
                        tokens.push(prompts[s][done[s]..end].to_vec());
                        who.push((s, end == prompts[s].len(), prompts[s].len(), end));
                    } else {
                        tokens.push(vec![argmax(seen[s].last().unwrap()) as u32]);
                        who.push((s, true, e.position_in(s) + 1, usize::MAX));
                    }
                }
                let parts: Vec<StepPart> = who
                    .iter()
                    .zip(&tokens)
                    .map(|(&(slot, logits, seq_end, _), t)| StepPart {
                        slot,
                        tokens: t,
                        seq_end,
                        logits,
                    })
                    .collect();
                let out = e.step(&parts).expect("step").to_vec();
                let mut rows = out.chunks(vocab);
                for &(s, logits, _, end) in &who {
                    if end != usize::MAX {
                        done[s] = end;
                    }
                    if logits {
                        seen[s].push(rows.next().expect("logits row").to_vec());
                    }
                }
                turn += 1;
            }
            for s in 0..3 {
                for (k, (got, want)) in seen[s].iter().zip(&alone[s]).enumerate() {
                    let what = format!("{name}, chunks of {chunk}: sequence {s}, logits {k} against alone");
                    assert_split_agree(&what, e.spec(), got, want);
                }
            }
        }
    }
}

#[test]
fn generation_continues_across_prefill_calls() {
    // Prefilling a prompt in two calls must equal prefilling it at once (the chat path
    // prefills only each turn's new tokens).
    let case = &golden("qwen2").cases[3];
    let ids = &case.prompt_token_ids;
    let mut session = open("qwen2", 2, None);
    let whole = session.engine.prefill(ids).unwrap().to_vec();
    session.engine.reset();
    session.engine.prefill(&ids[..100]).unwrap();
    let split = session.engine.prefill(&ids[100..]).unwrap().to_vec();
    assert!(max_abs_diff(&whole, &split) <= 1e-5);
    assert_eq!(session.engine.position(), ids.len());
}

#[test]
fn layer_by_layer_prefill_matches_prefill() {
    let case = &golden("qwen3").cases[3];
    let ids = &case.prompt_token_ids;
    let mut session = open("qwen3", 2, None);
    let whole = session.engine.prefill(ids).unwrap().to_vec();
    session.engine.reset();
    let layers = session.engine.prefill_layer_by_layer(ids).unwrap();
    assert_eq!(layers.len(), session.spec.num_layers() + 1);
    assert!(
        layers
            .iter()
            .all(|l| l.len() == ids.len() && l[0].len() == session.spec.dims.hidden_size)
    );
    assert_eq!(
        session.engine.logits(),
        &whole[..],
        "the same numbers as the fused plans"
    );
    assert_ne!(layers[0], layers[1], "each layer changes the residual stream");
}

/// The longest prompt among `name`'s golden cases.
fn longest_prompt(name: &str) -> Vec<u32> {
    golden(name)
        .cases
        .into_iter()
        .map(|c| c.prompt_token_ids)
        .max_by_key(Vec::len)
        .unwrap()
}

/// Invariant: a checkpoint saved where a prompt ends lets a recurrent sequence be cut back to
/// that position or past it (the tokens after the checkpoint run again) with bitwise the logits
/// of a fresh run in the same calls; once the sequence was cut before it, restarted or reset,
/// it is never restored.
#[test]
fn recurrent_checkpoint_resumes_where_it_was_saved_and_only_there() {
    let ids = &longest_prompt("qwen3_5");
    let (n, half) = (ids.len(), ids.len() / 2);
    // Other tokens after the checkpoint, long enough to cut back into anywhere.
    let other: Vec<u32> = ids.iter().rev().copied().collect();
    let mut s = open("qwen3_5", 2, None);
    s.engine.prefill(&ids[..half]).unwrap();
    let fresh = s.engine.prefill(&ids[half..]).unwrap().to_vec();
    s.engine.reset();
    s.engine.prefill(&ids[..half]).unwrap();
    s.engine.checkpoint();
    s.engine.prefill(&other).unwrap();
    assert_eq!(s.engine.truncate(half + 1), half, "back to the checkpoint");
    assert_eq!(s.engine.prefill(&ids[half..]).unwrap(), &fresh[..], "resumed = fresh");
    assert_eq!(s.engine.truncate(n - 1), half, "the checkpoint stays valid");
    assert_eq!(s.engine.prefill(&ids[half..]).unwrap(), &fresh[..]);
    assert_eq!(s.engine.truncate(half - 1), 0, "before the checkpoint: a restart");
    s.engine.prefill(&other).unwrap();
    assert_eq!(s.engine.truncate(half + 1), 0, "a dropped checkpoint is never restored");
    s.engine.prefill(&ids[..half]).unwrap();
    s.engine.checkpoint();
    s.engine.reset();
    s.engine.prefill(&other).unwrap();
    assert_eq!(s.engine.truncate(half + 1), 0, "reset drops the checkpoint");
}

/// A recurrent model's state holds every token so far, so a sequence cannot be cut back to a
/// shorter prefix: without a checkpoint, `truncate` to less than the cached length restarts it at 0 (and says so),
/// and running the prompt again gives bitwise the logits of a fresh run, never ones computed
/// from a stale state. Cutting nothing keeps the state, and continuing from there equals one
/// longer prefill (to [`split_bound`]: the chunks fall elsewhere). A Llama-family model keeps
/// the prefix it is asked to.
#[test]
fn recurrent_truncation_restarts_and_never_reuses_stale_state() {
    let ids = &longest_prompt("qwen3_5");
    let mut session = open("qwen3_5", 2, None);
    let fresh = session.engine.prefill(ids).unwrap().to_vec();
    assert_eq!(
        session.engine.truncate(ids.len() + 5),
        ids.len(),
        "cutting nothing keeps everything"
    );
    assert_eq!(
        session.engine.truncate(ids.len() / 2),
        0,
        "a recurrent state cannot be cut back"
    );
    let again = session.engine.prefill(ids).unwrap().to_vec();
    assert_eq!(fresh, again, "a restarted sequence must not see the earlier state");
    // Prefix kept whole, then continued: the same as prefilling everything at once.
    session.engine.reset();
    let half = ids.len() / 2;
    session.engine.prefill(&ids[..half]).unwrap();
    assert_eq!(session.engine.truncate(half), half);
    let continued = session.engine.prefill(&ids[half..]).unwrap().to_vec();
    let what = "continuing a kept state against one prefill";
    assert_split_agree(what, &session.spec, &continued, &fresh);

    let mut llama = open("llama", 2, None);
    let ids = &golden("llama").cases[3].prompt_token_ids;
    llama.engine.prefill(ids).unwrap();
    assert_eq!(llama.engine.truncate(10), 10, "a KV cache keeps the prefix asked for");
}
