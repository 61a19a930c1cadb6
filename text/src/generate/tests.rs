//! `generate` against scripted models (no compiled library needed): stop strings, cancellation,
//! the KV-cache contract, penalties over the context, UTF-8 split across tokens, and the
//! reasoning filter.

use super::*;
use crate::tokenizer::Tokenizer;
use std::path::Path;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/qwen-bpe")).unwrap()
}

/// A model that answers with scripted logits: step `i` (0 = after the prefill) gives
/// `logits(i)`. Records what was fed.
struct Scripted<F: FnMut(usize) -> Vec<f32>> {
    logits: F,
    buf: Vec<f32>,
    step: usize,
    pos: usize,
    ctx: usize,
    fed: Vec<u32>,
}

impl<F: FnMut(usize) -> Vec<f32>> Scripted<F> {
    fn new(ctx: usize, logits: F) -> Self {
        Scripted {
            logits,
            buf: Vec::new(),
            step: 0,
            pos: 0,
            ctx,
            fed: Vec::new(),
        }
    }
}

impl<F: FnMut(usize) -> Vec<f32>> Model for Scripted<F> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        if self.pos + tokens.len() > self.ctx {
            return Err(EngineError::ContextFull {
                tokens: tokens.len(),
                pos: self.pos,
                ctx: self.ctx,
            });
        }
        self.pos += tokens.len();
        self.fed.extend_from_slice(tokens);
        self.buf = (self.logits)(self.step);
        self.step += 1;
        Ok(&self.buf)
    }
    fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.prefill(&[token])
    }
    fn position(&self) -> usize {
        self.pos
    }
    fn ctx(&self) -> usize {
        self.ctx
    }
}

/// Logits that make a greedy sampler write `ids` in order (then repeat the last one).
fn one_hot_script(vocab: usize, ids: Vec<u32>) -> impl FnMut(usize) -> Vec<f32> {
    move |step| {
        let mut l = vec![0.0; vocab];
        l[ids[step.min(ids.len() - 1)] as usize] = 10.0;
        l
    }
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateOptions::default()
    }
}

/// Runs a greedy generation that writes `ids`; returns the result and the pieces streamed.
fn run_script(ids: Vec<u32>, opts: &GenerateOptions) -> (Generation, Vec<String>, Vec<u32>, usize) {
    let tok = tokenizer();
    let mut model = Scripted::new(1000, one_hot_script(tok.vocab_size(), ids));
    let mut pieces = Vec::new();
    let generation = generate(&mut model, &tok, &[1, 2, 3], opts, &mut |p| pieces.push(p.to_string())).unwrap();
    (generation, pieces, model.fed.clone(), model.pos)
}

#[test]
fn streams_the_text_and_does_not_feed_the_last_token() {
    let tok = tokenizer();
    let ids = tok.encode("Hello world, hello there", false).unwrap();
    let (g, pieces, fed, pos) = run_script(ids.clone(), &greedy(ids.len()));
    assert_eq!(g.token_ids, ids);
    assert_eq!(g.text, "Hello world, hello there");
    assert_eq!(pieces.concat(), g.text);
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.stop_string, None);
    // The prompt and every generated token but the last are in the KV cache.
    assert_eq!(pos, 3 + ids.len() - 1);
    assert_eq!(&fed[3..], &ids[..ids.len() - 1]);
}

#[test]
fn eos_is_kept_in_the_ids_but_not_printed() {
    let tok = tokenizer();
    let mut ids = tok.encode("Hi there", false).unwrap();
    let eos = tok.token_to_id("<|endoftext|>").unwrap();
    ids.push(eos);
    let opts = GenerateOptions {
        eos_token_ids: vec![eos],
        ..greedy(50)
    };
    let (g, pieces, _, _) = run_script(ids.clone(), &opts);
    assert_eq!(g.stop, StopReason::Eos);
    assert_eq!(g.token_ids, ids);
    assert_eq!(pieces.concat(), "Hi there");
}

#[test]
fn stop_string_across_tokens_ends_generation_and_is_never_printed() {
    let tok = tokenizer();
    let ids = tok.encode("one two three four five", false).unwrap();
    assert!(ids.len() >= 5, "{ids:?}");
    let opts = GenerateOptions {
        stop: vec!["o thr".into()],
        ..greedy(100)
    };
    let (g, pieces, _, _) = run_script(ids.clone(), &opts);
    assert_eq!(g.stop, StopReason::StopString);
    assert_eq!(g.stop_string.as_deref(), Some("o thr"));
    assert_eq!(g.text, "one tw");
    assert_eq!(pieces.concat(), "one tw");
    assert!(pieces.iter().all(|p| !p.contains("thr")));
    // Generation ended with the token that completed the stop string.
    assert!(g.token_ids.len() < ids.len());
    let n = g.token_ids.len();
    assert!(tok.decode(&g.token_ids, true).unwrap().contains("o thr"));
    assert!(!tok.decode(&g.token_ids[..n - 1], true).unwrap().contains("o thr"));
}

#[test]
fn earliest_stop_string_wins_and_empty_ones_are_ignored() {
    let tok = tokenizer();
    let ids = tok.encode("alpha beta gamma delta", false).unwrap();
    let opts = GenerateOptions {
        stop: vec!["".into(), "delta".into(), "beta".into()],
        ..greedy(100)
    };
    let (g, pieces, _, _) = run_script(ids, &opts);
    assert_eq!(g.text, "alpha ");
    assert_eq!(pieces.concat(), "alpha ");
    assert_eq!(g.stop_string.as_deref(), Some("beta"));
}

#[test]
fn stop_string_longer_than_the_output_prints_everything() {
    let tok = tokenizer();
    let ids = tok.encode("one two three", false).unwrap();
    let opts = GenerateOptions {
        stop: vec!["one two three four five six seven".into()],
        ..greedy(ids.len())
    };
    let (g, pieces, _, _) = run_script(ids, &opts);
    assert_eq!(g.stop, StopReason::MaxTokens);
    assert_eq!(g.text, "one two three");
    // Everything was held back (it is all a beginning of the stop string), then released.
    assert_eq!(pieces.concat(), "one two three");
}

#[test]
fn stop_strings_hold_back_only_what_could_start_one() {
    let mut s = StopStrings::new(&["two!".to_string(), "é€".to_string()]);
    let mut out = String::new();
    assert!(!s.push("one t", &mut |t| out.push_str(t)));
    assert_eq!(out, "one ");
    assert!(!s.push("wo", &mut |t| out.push_str(t)));
    assert_eq!(out, "one ");
    assert!(!s.push(" three é", &mut |t| out.push_str(t)));
    assert_eq!(out, "one two three ");
    assert!(s.push("€ four", &mut |t| out.push_str(t)));
    assert_eq!(out, "one two three ");
    assert_eq!(s.text(), "one two three ");
    assert_eq!(s.matched(), Some("é€"));
    // Nothing is accepted after a match.
    assert!(s.push("more", &mut |t| out.push_str(t)));
    s.finish(&mut |t| out.push_str(t));
    assert_eq!(out, "one two three ");

    let mut s = StopStrings::new(&[]);
    let mut out = String::new();
    assert!(!s.push("abc", &mut |t| out.push_str(t)));
    assert_eq!(out, "abc");
}

#[test]
fn cancel_stops_before_the_next_token() {
    let tok = tokenizer();
    let ids = tok.encode("one two three four five six", false).unwrap();
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = GenerateOptions {
        cancel: Some(cancel.clone()),
        ..greedy(100)
    };
    let mut model = Scripted::new(1000, one_hot_script(tok.vocab_size(), ids));
    let mut pieces = 0;
    let g = generate(&mut model, &tok, &[1], &opts, &mut |_| {
        pieces += 1;
        cancel.store(true, Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(g.stop, StopReason::Cancelled);
    assert_eq!(g.token_ids.len(), 1);
    assert_eq!(pieces, 1);
    assert_eq!(model.position(), 1, "the cancelled token is not fed");

    // Already set: nothing is generated.
    let mut model = Scripted::new(1000, one_hot_script(tok.vocab_size(), vec![5]));
    let g = generate(&mut model, &tok, &[1], &opts, &mut |_| {}).unwrap();
    assert_eq!(g.stop, StopReason::Cancelled);
    assert!(g.token_ids.is_empty());
}

#[test]
fn context_full_stops_generation() {
    let tok = tokenizer();
    let ids = tok.encode("one two three four five six seven eight", false).unwrap();
    let mut model = Scripted::new(6, one_hot_script(tok.vocab_size(), ids));
    let g = generate(&mut model, &tok, &[1, 2], &greedy(100), &mut |_| {}).unwrap();
    assert_eq!(g.stop, StopReason::ContextFull);
    assert_eq!(model.position(), 6);
    assert_eq!(g.token_ids.len(), 5);
}

#[test]
fn max_tokens_zero_only_prefills() {
    let (g, pieces, fed, _) = run_script(vec![5], &greedy(0));
    assert!(g.token_ids.is_empty() && pieces.is_empty());
    assert_eq!(fed, vec![1, 2, 3]);
    assert_eq!(g.stop, StopReason::MaxTokens);
}

#[test]
fn penalties_see_the_context_before_the_prompt() {
    let tok = tokenizer();
    // Token 7 is the most likely, 8 a close second.
    let logits = |_| {
        let mut l = vec![0.0; tokenizer().vocab_size()];
        l[7] = 3.0;
        l[8] = 2.9;
        l
    };
    let params = SamplingParams {
        repetition_penalty: 2.0,
        ..SamplingParams::greedy()
    };
    let opts = GenerateOptions {
        sampling: params,
        ..greedy(1)
    };
    let mut sampler = Sampler::new(params);
    let mut model = Scripted::new(100, logits);
    let g = generate_with(&mut model, &tok, &mut sampler, &[], &[1], &opts, &mut |_| {}).unwrap();
    assert_eq!(g.token_ids, vec![7]);
    let mut model = Scripted::new(100, logits);
    let g = generate_with(&mut model, &tok, &mut sampler, &[7], &[1], &opts, &mut |_| {}).unwrap();
    assert_eq!(g.token_ids, vec![8], "7 is in the context, so it is penalised");
    assert_eq!(model.fed, vec![1], "only the prompt is prefilled");
}

/// GPT-2's byte-to-character map: the token of one raw byte in a byte-level BPE vocabulary.
fn byte_token(tok: &Tokenizer, b: u8) -> u32 {
    let printable = |c: u32| (33..=126).contains(&c) || (161..=172).contains(&c) || (174..=255).contains(&c);
    let c = if printable(b as u32) {
        b as u32
    } else {
        256 + (0..b as u32).filter(|&x| !printable(x)).count() as u32
    };
    tok.token_to_id(&char::from_u32(c).unwrap().to_string()).unwrap()
}

#[test]
fn characters_split_across_tokens_are_never_printed_half() {
    let tok = tokenizer();
    let text = "a🦀é€b";
    let ids: Vec<u32> = text.bytes().map(|b| byte_token(&tok, b)).collect();
    let (g, pieces, _, _) = run_script(ids.clone(), &greedy(ids.len()));
    assert_eq!(g.text, text);
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");

    // The output ends in the middle of a character (an invalid sequence): the incomplete
    // bytes come out as U+FFFD at the end, no error, no panic.
    let crab = "🦀".as_bytes();
    let ids: Vec<u32> = [b'x', crab[0], crab[1], crab[2]]
        .iter()
        .map(|&b| byte_token(&tok, b))
        .collect();
    let (g, pieces, _, _) = run_script(ids.clone(), &greedy(ids.len()));
    assert_eq!(pieces.concat(), g.text);
    assert!(g.text.starts_with('x') && g.text.ends_with('\u{FFFD}'), "{:?}", g.text);

    // A stray continuation byte in the middle, with a stop string after it.
    let ids: Vec<u32> = [b'x', 0x80, b'y', b'!', b'z']
        .iter()
        .map(|&b| byte_token(&tok, b))
        .collect();
    let opts = GenerateOptions {
        stop: vec!["!".into()],
        ..greedy(ids.len())
    };
    let (g, pieces, _, _) = run_script(ids, &opts);
    assert_eq!(g.stop, StopReason::StopString);
    assert_eq!(pieces.concat(), g.text);
    assert!(
        g.text.starts_with('x') && g.text.ends_with('y') && g.text.contains('\u{FFFD}'),
        "{:?}",
        g.text
    );
}

fn parts(filter: &mut ThinkFilter, chunks: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut take = |p: Part<'_>| {
        out.push(match p {
            Part::Answer(t) => format!("A:{t}"),
            Part::Thinking(t) => format!("T:{t}"),
            Part::Open => "<open>".to_string(),
            Part::Close => "<close>".to_string(),
        })
    };
    for c in chunks {
        filter.push(c, &mut take);
    }
    filter.finish(&mut take);
    out
}

#[test]
fn think_filter_recognises_tags_split_across_pieces() {
    let mut f = ThinkFilter::new(false);
    let got = parts(&mut f, &["<th", "ink>Let me", " see</", "think", ">\n\nYes <", "b>"]);
    assert_eq!(got, ["<open>", "T:Let me", "T: see", "<close>", "A:\n\nYes ", "A:<b>"]);
    assert!(!f.is_thinking());

    // Started inside a block (the prompt opened it).
    let mut f = ThinkFilter::new(true);
    assert_eq!(parts(&mut f, &["hmm</think>ok"]), ["T:hmm", "<close>", "A:ok"]);
    // Unclosed block at the end: the held-back tail is released as reasoning.
    let mut f = ThinkFilter::new(false);
    assert_eq!(parts(&mut f, &["<think>abc</thi"]), ["<open>", "T:abc", "T:</thi"]);
    assert!(f.is_thinking());
    // Multibyte text next to a partial tag.
    let mut f = ThinkFilter::new(false);
    assert_eq!(parts(&mut f, &["é<", "€"]), ["A:é", "A:<€"]);
}

#[test]
fn thinking_helpers() {
    assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
    assert!(!prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
    assert_eq!(
        split_thinking("<think>\nwhy\n</think>\n\nBecause.", false),
        ("\nwhy\n".to_string(), "Because.".to_string())
    );
    assert_eq!(split_thinking("plain", false), (String::new(), "plain".to_string()));
}

#[test]
fn think_tokens_from_a_model_are_classified() {
    let tok = tokenizer();
    let ids = tok.encode("<think>I think</think>\n\nDone", false).unwrap();
    assert_eq!(ids[0], tok.token_to_id("<think>").unwrap());
    let (g, pieces, _, _) = run_script(ids.clone(), &greedy(ids.len()));
    let mut f = ThinkFilter::new(false);
    let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let got = parts(&mut f, &refs);
    assert_eq!(got.first().map(String::as_str), Some("<open>"));
    assert!(got.contains(&"<close>".to_string()), "{got:?}");
    assert_eq!(split_thinking(&g.text, false).1, "Done");
}
