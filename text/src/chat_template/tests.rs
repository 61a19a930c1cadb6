use std::path::PathBuf;

use serde::Deserialize;

use super::python::{DateTime, py_float_repr};
use super::*;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/chat_templates")
}

#[derive(Deserialize)]
struct Tokens {
    bos_token: Option<String>,
    eos_token: Option<String>,
}

#[derive(Deserialize)]
struct Case {
    template: String,
    name: String,
    messages: Vec<Message>,
    #[serde(default)]
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
    tools: Option<minijinja::Value>,
    extra: Option<minijinja::Value>,
    expected: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct Expected {
    now: String,
    cases: Vec<Case>,
}

fn load_template(name: &str) -> ChatTemplate {
    let dir = data_dir();
    let source = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
    let tokens: Tokens =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap()).unwrap();
    ChatTemplate::new(&source, tokens.bos_token.as_deref(), tokens.eos_token.as_deref())
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The JSON text of a fixture's `tools` or `extra`. They are read as MiniJinja values, whose maps
/// keep the file's key order (serde_json's own `Value` would sort them, and Python's `json.dumps`
/// keeps insertion order, which the renderings show).
fn json_text(value: &minijinja::Value) -> String {
    serde_json::to_string(value).unwrap()
}

#[test]
fn renders_like_transformers() {
    let text = std::fs::read_to_string(data_dir().join("expected.json")).unwrap();
    let expected: Expected = serde_json::from_str(&text).unwrap();
    let now = DateTime::parse_iso(&expected.now).expect("`now` of expected.json");
    let mut failures = Vec::new();
    let mut checked = 0;
    let mut templates: Vec<(String, ChatTemplate)> = Vec::new();
    for case in &expected.cases {
        if !templates.iter().any(|(n, _)| n == &case.template) {
            templates.push((case.template.clone(), load_template(&case.template)));
        }
        let template = &templates.iter().find(|(n, _)| n == &case.template).unwrap().1;
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            enable_thinking: case.enable_thinking,
            tools: case.tools.as_ref().map(json_text),
            extra: case.extra.as_ref().map(json_text),
            now: Some(now),
        };
        let got = template.render(&case.messages, &opts);
        let label = format!("{}/{}", case.template, case.name);
        match (&case.expected, &case.error, got) {
            (Some(want), _, Ok(got)) if *want == got => {}
            (Some(want), _, Ok(got)) => failures.push(format!(
                "{label}: rendering differs\n--- want\n{want}\n--- got\n{got}\n---"
            )),
            (Some(_), _, Err(e)) => failures.push(format!("{label}: unexpected error: {e}")),
            (None, Some(want), Err(e)) => {
                let msg = e.to_string();
                if !matches!(e, ChatTemplateError::Raised(_)) || !msg.contains(want.as_str()) {
                    failures.push(format!("{label}: error {msg:?} does not carry {want:?}"));
                }
                assert!(!msg.contains('\n'), "{label}: multi-line error {msg:?}");
            }
            (None, Some(want), Ok(got)) => {
                failures.push(format!("{label}: rendered {got:?}, wanted the error {want:?}"))
            }
            (None, None, _) => panic!("{label}: fixture has neither `expected` nor `error`"),
        }
        checked += 1;
    }
    assert!(checked >= 60, "only {checked} fixture cases");
    assert!(
        expected.cases.iter().any(|c| c.error.is_some()),
        "the fixtures must include a rejected conversation"
    );
    assert!(
        failures.is_empty(),
        "{} of {checked} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn render_src(source: &str, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatTemplateError> {
    ChatTemplate::new(source, Some("<s>"), Some("</s>"))?.render(messages, opts)
}

#[test]
fn syntax_error_names_the_line() {
    let src = "{% for m in messages %}\n{{ m.content }}\n{% if %}\n{% endfor %}";
    let err = ChatTemplate::new(src, None, None).unwrap_err();
    assert!(
        matches!(err, ChatTemplateError::Syntax { line: Some(3), .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.starts_with("chat template syntax error at line 3: "), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");

    let err = ChatTemplate::new("ok\n\n{{ unclosed", None, None).unwrap_err();
    assert!(err.to_string().contains("line 3"), "{err}");
}

#[test]
fn missing_template_message() {
    let err = ChatTemplateError::Missing {
        model: "models/base-llm".into(),
    };
    assert_eq!(
        err.to_string(),
        "model models/base-llm has no chat template; run without --chat"
    );
}

fn qwen_tokenizer(config: serde_json::Value) -> Tokenizer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/qwen-bpe");
    let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
    Tokenizer::from_json_bytes(&json, Some(&serde_json::to_vec(&config).unwrap())).unwrap()
}

#[test]
fn from_tokenizer_uses_its_template_and_tokens() {
    let source = std::fs::read_to_string(data_dir().join("qwen2_5.jinja")).unwrap();
    let tok = qwen_tokenizer(serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": source,
    }));
    let template = ChatTemplate::from_tokenizer(&tok).unwrap().expect("a template");
    assert_eq!(template.bos_token(), None);
    assert_eq!(template.eos_token(), Some("<|im_end|>"));
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..RenderOptions::default()
    };
    let text = template.render(&[Message::user("Hi")], &opts).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // The special tokens are written as text and come back as their single ids.
    let ids = tok.encode(&text, false).unwrap();
    let im_start = tok.token_to_id("<|im_start|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 3);

    let bare = qwen_tokenizer(serde_json::json!({ "eos_token": "<|im_end|>" }));
    assert!(ChatTemplate::from_tokenizer(&bare).unwrap().is_none());
    let err = ChatTemplate::require(&bare, "tiny-qwen").unwrap_err();
    assert_eq!(
        err.to_string(),
        "model tiny-qwen has no chat template; run without --chat"
    );
}

#[test]
fn html_is_not_escaped() {
    let text = render_src(
        "{{ messages[0].content }}|{{ bos_token }}",
        &[Message::user("<b>\"Tom\" & 'Jerry'</b>")],
        &RenderOptions::default(),
    )
    .unwrap();
    assert_eq!(text, "<b>\"Tom\" & 'Jerry'</b>|<s>");
}

#[test]
fn raise_exception_is_a_one_line_error_with_the_message() {
    let src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...\\nreally') }}{% endif %}";
    let err = render_src(src, &[Message::user("x")], &RenderOptions::default()).unwrap_err();
    assert_eq!(
        err,
        ChatTemplateError::Raised("Conversation roles must alternate user/assistant/user/assistant/... really".into())
    );
    assert_eq!(
        err.to_string(),
        "the chat template rejected the conversation: Conversation roles must alternate \
         user/assistant/user/assistant/... really"
    );
}

#[test]
fn other_render_errors_carry_the_line() {
    let src = "line one\n{{ messages[0].nope.deeper }}";
    let err = render_src(src, &[Message::user("x")], &RenderOptions::default()).unwrap_err();
    assert!(
        matches!(err, ChatTemplateError::Render { line: Some(2), .. }),
        "{err:?}"
    );
    assert!(!err.to_string().contains('\n'));
}

#[test]
fn empty_conversation_and_bad_options() {
    let t = ChatTemplate::new("{{ messages | length }}", None, None).unwrap();
    assert_eq!(
        t.render(&[], &RenderOptions::default()).unwrap_err(),
        ChatTemplateError::EmptyConversation
    );
    let bad_tools = RenderOptions {
        tools: Some("{not json".into()),
        ..RenderOptions::default()
    };
    let err = t.render(&[Message::user("x")], &bad_tools).unwrap_err();
    assert!(
        matches!(err, ChatTemplateError::Options { option: "tools", .. }),
        "{err:?}"
    );
    let not_a_list = RenderOptions {
        tools: Some("{\"a\": 1}".into()),
        ..RenderOptions::default()
    };
    assert!(t.render(&[Message::user("x")], &not_a_list).is_err());
    let not_an_object = RenderOptions {
        extra: Some("[1]".into()),
        ..RenderOptions::default()
    };
    assert!(t.render(&[Message::user("x")], &not_an_object).is_err());
}

#[test]
fn variables_as_transformers_passes_them() {
    let src = "{{ tools is defined }} {{ tools is none }} {{ documents is none }} \
               {{ enable_thinking is defined }} {{ add_generation_prompt }} {{ date_string }} \
               {{ bos_token }} {{ eos_token is defined }}";
    let t = ChatTemplate::new(src, Some("<|begin_of_text|>"), None).unwrap();
    let msgs = [Message::user("x")];
    assert_eq!(
        t.render(&msgs, &RenderOptions::default()).unwrap(),
        "True True True False False  <|begin_of_text|> False"
    );
    let opts = RenderOptions {
        add_generation_prompt: true,
        enable_thinking: Some(false),
        tools: Some("[]".into()),
        extra: Some(r#"{"date_string": "26 Jul 2024", "bos_token": "<B>", "messages": "ignored"}"#.into()),
        now: None,
    };
    assert_eq!(
        t.render(&msgs, &opts).unwrap(),
        "True False True True True 26 Jul 2024 <B> False"
    );
}

#[test]
fn generation_tags_render_their_body() {
    assert_eq!(
        rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}{% endif %}"),
        "a{%- if true -%}b{% endif %}c{% if x %}{% endif %}"
    );
    assert_eq!(rewrite_generation_tags("{% generations %}"), "{% generations %}");
    let src = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}";
    let text = render_src(
        src,
        &[Message::user("q"), Message::assistant("a")],
        &RenderOptions::default(),
    )
    .unwrap();
    assert_eq!(text, "[q]a");
}

#[test]
fn strftime_like_python() {
    let t = DateTime::parse_iso("2024-09-05T14:03:07").unwrap();
    assert_eq!(t.strftime("%d %b %Y").unwrap(), "05 Sep 2024");
    assert_eq!(
        t.strftime("%A %j %I%p %f%z%Z %%z").unwrap(),
        "Thursday 249 02PM 000000 %z"
    );
    assert_eq!(t.strftime("").unwrap(), "");
    let t = DateTime::parse_iso("2000-02-29 00:00:00.5").unwrap();
    assert_eq!(t.strftime("%a %Y-%m-%d %f").unwrap(), "Tue 2000-02-29 500000");
    assert!(DateTime::parse_iso("2023-02-29T00:00:00").is_none());
    let year: i32 = DateTime::now().strftime("%Y").unwrap().parse().unwrap();
    assert!(year >= 2024, "{year}");
    // Without a pinned time, `strftime_now` reads the clock.
    let text = render_src(
        "{{ strftime_now('%Y') }}",
        &[Message::user("x")],
        &RenderOptions::default(),
    )
    .unwrap();
    assert!(text.parse::<i32>().unwrap() >= 2024, "{text}");
}

#[test]
fn python_float_repr() {
    for (f, want) in [
        (1.0, "1.0"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e16, "1e+16"),
        (1e15, "1000000000000000.0"),
        (123456789.125, "123456789.125"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (-2.5e-7, "-2.5e-07"),
        (1.5e300, "1.5e+300"),
        (-0.0, "-0.0"),
        (f64::INFINITY, "inf"),
    ] {
        assert_eq!(py_float_repr(f), want, "{f:e}");
    }
}

#[test]
fn message_json_shape() {
    let m: Message = serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
    assert_eq!(m, Message::user("hi"));
    assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"user","content":"hi"}"#);
    let mut a = Message::assistant("Paris.");
    a.reasoning_content = Some("Easy.".into());
    let back: Message = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
    assert_eq!(back, a);
}
