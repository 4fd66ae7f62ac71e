//! Chat templates through the engine's API: where the one in use comes from
//! (`model-info.chat-template`), the built-in ones, and `set-chat-template` with its errors.

use wisp::{ChatTemplate, EngineError, GpuCtx, GpuMode};
use wisp_tests::{model, open, qwen_golden_cases, qwen_model};

fn msgs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(r, c)| (r.to_string(), c.to_string())).collect()
}

#[test]
fn a_file_template_is_the_files_and_chatml_matches_qwens_for_a_plain_chat() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::File));
    // The golden chat case: a system and a user message, rendered by Qwen's own template.
    let case = qwen_golden_cases().into_iter().find(|c| c.name == "chat").expect("a chat case");
    let system = case.prompt.split("<|im_start|>system\n").nth(1).and_then(|s| s.split("<|im_end|>").next()).unwrap();
    let user = case.prompt.split("<|im_start|>user\n").nth(1).and_then(|s| s.split("<|im_end|>").next()).unwrap();
    let messages = msgs(&[("system", system), ("user", user)]);
    assert_eq!(inst.apply_chat_template(m, &messages, true).unwrap().unwrap(), case.prompt);
    inst.set_chat_template(m, "chatml").unwrap().unwrap();
    assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::Builtin("chatml".into())));
    assert_eq!(inst.apply_chat_template(m, &messages, true).unwrap().unwrap(), case.prompt);
}

#[test]
fn a_file_without_a_template_says_which_built_in_one_it_gets_and_takes_another() {
    let (mut inst, m) = open(model(), GpuCtx::none(), GpuMode::Off);
    // Gemma 3 270M (a base model) carries no template; its vocabulary has Gemma's turn markers.
    assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::Builtin("gemma".into())));
    let hi = msgs(&[("user", "Hi")]);
    assert_eq!(inst.apply_chat_template(m, &hi, true).unwrap().unwrap(), "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");

    inst.set_chat_template(m, "llama3").unwrap().unwrap();
    assert_eq!(
        inst.apply_chat_template(m, &hi, true).unwrap().unwrap(),
        "<bos><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );

    // A Jinja template of the caller's, with the variables Hugging Face's templates use.
    let custom = "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}\
                  {% if add_generation_prompt %}[ASSISTANT] {% endif %}";
    inst.set_chat_template(m, custom).unwrap().unwrap();
    assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::Custom));
    let two = msgs(&[("system", "Be brief."), ("user", "Hi")]);
    assert_eq!(inst.apply_chat_template(m, &two, true).unwrap().unwrap(), "<bos>[SYSTEM] Be brief.\n[USER] Hi\n[ASSISTANT] ");
    let rendered = inst.apply_chat_template(m, &two, false).unwrap().unwrap();

    // Each bad template is a typed error and leaves the one in use as it was.
    let too_long = format!("{{{{ bos_token }}}}{}", " ".repeat(1 << 20));
    let cases: [(&str, &str); 3] = [
        ("alpaca", "unknown chat template \"alpaca\": the built-in ones are gemma, chatml, llama3"),
        ("{% for m in messages %}{{ m.content }}", "the chat template does not compile"),
        (&too_long, "longer than the limit of 1048576"),
    ];
    for (bad, needle) in cases {
        match inst.set_chat_template(m, bad).unwrap() {
            Err(EngineError::InvalidArgument(msg)) => assert!(msg.contains(needle), "{msg}"),
            other => panic!("{:?}: {other:?}", &bad[..bad.len().min(40)]),
        }
        assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::Custom));
        assert_eq!(inst.apply_chat_template(m, &two, false).unwrap().unwrap(), rendered);
    }
    // A template that compiles but fails on a conversation fails that call only.
    inst.set_chat_template(m, "{{ raise_exception('no system messages') if messages[0].role == 'system' }}ok").unwrap().unwrap();
    assert!(matches!(inst.apply_chat_template(m, &two, true).unwrap(), Err(EngineError::InvalidArgument(e)) if e.contains("no system messages")));
    assert_eq!(inst.apply_chat_template(m, &hi, true).unwrap().unwrap(), "ok");
}

#[test]
fn a_runaway_template_fails_and_a_long_chat_renders() {
    let (mut inst, m) = open(model(), GpuCtx::none(), GpuMode::Off);
    let hi = msgs(&[("user", "Hi")]);
    // 10^10 loop steps run out of minijinja's fuel; 100 MB of text is over the cap on a
    // rendering: each a typed error of that call, in bounded time and memory.
    let cases = [
        ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "ran out of fuel"),
        ("{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "over the limit of 16777216 bytes"),
    ];
    for (bad, needle) in cases {
        inst.set_chat_template(m, bad).unwrap().unwrap();
        match inst.apply_chat_template(m, &hi, true).unwrap() {
            Err(EngineError::InvalidArgument(e)) => assert!(e.contains(needle), "{e}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
    // The built-in templates render a conversation of 4096 messages (the server's limit)
    // within the fuel.
    let long: Vec<(String, String)> =
        (0..4096).map(|i| (if i % 2 == 0 { "user" } else { "assistant" }.to_string(), format!("message {i}"))).collect();
    for name in ["gemma", "chatml", "llama3"] {
        inst.set_chat_template(m, name).unwrap().unwrap();
        let text = inst.apply_chat_template(m, &long, true).unwrap().unwrap();
        assert!(text.contains("message 4095"), "{name}");
    }
}
