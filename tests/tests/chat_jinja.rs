//! Each family's own chat template (tests/chat/templates) rendered by wisp exactly as llama.cpp's
//! server renders it with `--jinja`: tests/chat/record.py recorded llama.cpp's renderings into
//! tests/chat/rendered.json, for a tiny model with the family's BOS and EOS texts and template;
//! wisp renders each conversation for the same tiny model (tests/chat/tiny_model.py), the
//! template being the file's own (`tokenizer.chat_template`). llama.cpp's clock gives
//! `strftime_now`, `date_string` and `datetime`: the recorded dates are replaced by wisp's own of
//! the same formats before comparing. Conversations with tools (calls, results) go through
//! `render-chat` for the families whose templates write calls in a syntax wisp reads, which it
//! must also name. Without python3 and the `gguf` package the test skips
//! locally and fails under `CI=true`.

use std::collections::BTreeMap;
use wisp::{ChatTemplate, GpuCtx, GpuMode, ToolSyntax};
use wisp_tests::{open, python, root};

#[test]
fn every_family_template_renders_as_llama_cpp_renders_it() {
    let recorded: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("tests/chat/rendered.json")).expect("reading rendered.json"))
            .expect("rendered.json is JSON");
    let out = std::env::temp_dir().join(format!("wisp-chat-jinja-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let mut failures = Vec::new();
    let mut rendered = 0;
    let mut tools = 0;
    for family in recorded["families"].as_array().expect("families") {
        let name = family["family"].as_str().unwrap();
        let model = out.join(format!("{name}.gguf"));
        let (bos, eos) = (family["bos_token"].as_str().unwrap(), family["eos_token"].as_str().unwrap());
        let template = root().join("tests/chat/templates").join(family["template"].as_str().unwrap());
        if !python("chat/tiny_model.py", &[model.as_os_str(), bos.as_ref(), eos.as_ref(), template.as_os_str()], "gguf and numpy") {
            return;
        }
        let cases: Vec<&serde_json::Value> =
            recorded["cases"].as_array().unwrap().iter().filter(|c| c["family"] == family["family"]).collect();
        assert!(!cases.is_empty(), "{name} has no recorded case");

        // wisp's date in each format llama.cpp's renderings hold, by a template of the test's.
        let mut today = BTreeMap::new();
        let (mut clock, c) = open(&model, GpuCtx::none(), GpuMode::Off);
        for format in cases.iter().flat_map(|c| c["dates"].as_object().unwrap().keys()) {
            clock.set_chat_template(c, &format!("{{{{ strftime_now({format:?}) }}}}")).unwrap().unwrap();
            today.insert(format.clone(), clock.apply_chat_template(c, &[], false).unwrap().unwrap());
        }

        let (mut inst, m) = open(&model, GpuCtx::none(), GpuMode::Off);
        assert_eq!(inst.model_info(m).unwrap().chat_template, Some(ChatTemplate::File), "{name}");
        // Each date format is in some rendering: the replacement below is exercised.
        let mut dated = BTreeMap::new();
        for case in cases {
            let add_prompt = case["add_generation_prompt"].as_bool().unwrap();
            let mut expected = case["prompt"].as_str().unwrap().to_string();
            for (format, date) in case["dates"].as_object().unwrap() {
                let date = date.as_str().unwrap();
                *dated.entry(format.clone()).or_insert(0) += usize::from(expected.contains(date));
                expected = expected.replace(date, &today[format]);
            }
            let what = format!("{name} ({}), {}, add_generation_prompt {add_prompt}", family["template"], case["conversation"]);
            let text = match case.get("request") {
                // A conversation with tools (OpenAI's shape), through `render-chat`: the text, and
                // the syntax the model will write its calls in.
                Some(request) => inst.render_chat(m, &request.to_string(), add_prompt).unwrap().map(|(text, syntax)| {
                    let want = match case["tool_syntax"].as_str() {
                        Some("llama3-json") => ToolSyntax::Llama3Json,
                        _ => ToolSyntax::Hermes,
                    };
                    if syntax != want {
                        failures.push(format!("{what}: the tool syntax is {syntax:?}, not {want:?}"));
                    }
                    tools += 1;
                    text
                }),
                None => {
                    let messages: Vec<(String, String)> = case["messages"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|m| (m[0].as_str().unwrap().to_string(), m[1].as_str().unwrap().to_string()))
                        .collect();
                    inst.apply_chat_template(m, &messages, add_prompt).unwrap()
                }
            };
            match text {
                Ok(text) if text == expected => rendered += 1,
                Ok(text) => failures.push(format!("{what}:\n  llama.cpp {expected:?}\n  wisp      {text:?}")),
                Err(e) => failures.push(format!("{what}: {e:?}")),
            }
        }
        for (format, n) in dated {
            assert!(n > 0, "{name}: no rendering holds the date of {format:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&out);
    let total = failures.len() + rendered;
    assert!(failures.is_empty(), "{} of {total} renderings differ from llama.cpp's:\n{}", failures.len(), failures.join("\n"));
    assert!(tools >= 28, "only {tools} renderings with tools");
    eprintln!("{rendered} renderings equal llama.cpp's, {tools} of them with tools");
}
