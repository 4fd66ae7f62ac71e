//! The second family, Qwen2.5-Coder-0.5B-Instruct (`qwen2`, byte-level BPE, chat template),
//! through the component: llama.cpp's token ids, the golden thresholds on the CPU path and on
//! the devices, and the model's chat template.

use wisp::golden::Case;
use wisp::{Budget, CpuBackend, GpuCtx, GpuMode, Instance, LoadOptions, Model, NativeBackend, Precision, Sampling};
use wisp_tests::{golden_passes, open, qwen_golden_cases, qwen_model, wgpu_backend};

fn check(inst: &mut Instance, m: Model, cases: &[Case]) {
    for case in cases {
        golden_passes(inst, m, case, "");
    }
}

/// The cases the device paths run (the CPU reference device is slow).
fn some_cases() -> Vec<Case> {
    qwen_golden_cases().into_iter().filter(|c| c.name == "binary-search" || c.name == "chat").collect()
}

/// `(role, content)` messages of a prompt rendered with the ChatML template, and whether it ends
/// with the opening of the assistant's turn.
fn chatml_messages(text: &str) -> (Vec<(String, String)>, bool) {
    let mut messages = Vec::new();
    let mut generation_prompt = false;
    for block in text.split("<|im_start|>").skip(1) {
        let (role, rest) = block.split_once('\n').expect("a role line");
        match rest.strip_suffix("<|im_end|>\n") {
            Some(content) => messages.push((role.to_string(), content.to_string())),
            None => {
                assert!(rest.is_empty() && role == "assistant", "only the last turn is open: {block:?}");
                generation_prompt = true;
            }
        }
    }
    (messages, generation_prompt)
}

#[test]
fn the_model_is_qwen2_with_a_gpt2_tokenizer() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    let info = inst.model_info(m).unwrap();
    assert_eq!(info.architecture, "qwen2");
    assert_eq!(info.tokenizer, "gpt2");
    assert_eq!((info.n_layers, info.n_embd, info.n_vocab), (24, 896, 151936));
    // <|im_end|> (the file's EOS) and <|endoftext|> end a generation; <|im_start|> does not.
    assert_eq!(info.eos, Some(151645));
    assert!(inst.is_end_of_generation(m, 151645).unwrap());
    assert!(inst.is_end_of_generation(m, 151643).unwrap());
    assert!(!inst.is_end_of_generation(m, 151644).unwrap());
}

#[test]
fn the_tokenizer_gives_llama_cpp_ids_for_every_golden_case() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    for case in qwen_golden_cases() {
        // No BOS (add_bos_token is false); `<|im_start|>` and the like are special tokens.
        let ids = inst.tokenize(m, &case.prompt, true, true).unwrap().unwrap();
        assert_eq!(ids, case.prompt_tokens, "case {}", case.name);
        let text = inst.detokenize(m, &ids, true).unwrap().unwrap();
        assert_eq!(text, case.prompt, "case {} round trip", case.name);
    }
    // Without parse-special, control-token text is plain text.
    let plain = inst.tokenize(m, "<|im_start|>", true, false).unwrap().unwrap();
    assert!(plain.len() > 1 && !plain.contains(&151644), "{plain:?}");
}

#[test]
fn every_golden_case_passes_on_the_cpu() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    check(&mut inst, m, &qwen_golden_cases());
}

#[test]
fn the_chat_template_renders_the_chat_case() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    let case = qwen_golden_cases().into_iter().find(|c| c.name == "chat").expect("a chat case");
    let (messages, generation_prompt) = chatml_messages(&case.prompt);
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert!(generation_prompt);
    let text = inst.apply_chat_template(m, &messages, true).unwrap().unwrap();
    assert_eq!(text, case.prompt);
    // Without a system message the template supplies Qwen's own.
    let text = inst.apply_chat_template(m, &messages[1..], false).unwrap().unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud."), "{text}");
    assert!(text.ends_with("<|im_end|>\n"), "{text}");
}

#[test]
fn a_greedy_chat_reply_ends_at_end_of_turn() {
    let (mut inst, m) = open(qwen_model(), GpuCtx::none(), GpuMode::Off);
    let messages = [("user".to_string(), "Reply with the single word: yes".to_string())];
    let text = inst.apply_chat_template(m, &messages, true).unwrap().unwrap();
    let prompt = inst.tokenize(m, &text, true, true).unwrap().unwrap();
    let s = inst.new_session(m, prompt.len() as u32 + 32).unwrap().unwrap();
    inst.feed(s, &prompt).unwrap().unwrap();
    let mut reply = Vec::new();
    let ended = (0..32).any(|_| {
        let step = inst.next(s, &Sampling::default()).unwrap().unwrap();
        reply.extend(step.piece);
        step.end_of_generation
    });
    let reply = String::from_utf8_lossy(&reply);
    assert!(ended, "no end of turn in {reply:?}");
    assert!(reply.to_lowercase().contains("yes"), "{reply:?}");
}

/// The golden cases with every product on the device `gpu` offers, in `precision`, and a
/// session's step there with no fallback to the guest's CPU.
fn golden_on_the_device(gpu: GpuCtx, precision: Precision) {
    let (mut inst, m) = open(qwen_model(), gpu, LoadOptions { gpu: GpuMode::On, precision });
    let info = inst.model_info(m).unwrap();
    // 24 layers x 7 weights and the output projection.
    assert_eq!(info.gpu_weights, 24 * 7 + 1, "{precision:?}: weights resident");
    check(&mut inst, m, &some_cases());
    let s = inst.new_session(m, 8).unwrap().unwrap();
    inst.feed(s, &[785, 12884]).unwrap().unwrap();
    let stats = inst.stats(s).unwrap();
    assert!(stats.gpu_calls > 0 && stats.gpu_fallbacks == 0, "{precision:?}: {stats:?}");
}

#[test]
fn golden_cases_pass_through_the_cpu_reference_device() {
    golden_on_the_device(GpuCtx::new(Box::new(CpuBackend::new()), Budget::default()), Precision::Exact);
}

#[test]
fn golden_cases_pass_on_the_native_device_in_both_precisions() {
    for precision in [Precision::Exact, Precision::Fast] {
        golden_on_the_device(GpuCtx::new(Box::new(NativeBackend::new(2).expect("two worker threads")), Budget::default()), precision);
    }
}

#[test]
fn golden_cases_pass_on_wgpu() {
    let Some(backend) = wgpu_backend() else { return };
    let (mut inst, m) = open(qwen_model(), GpuCtx::new(Box::new(backend), Budget::default()), GpuMode::On);
    let info = inst.model_info(m).unwrap();
    eprintln!("device {:?}, {} weights resident", info.device, info.gpu_weights);
    assert!(info.gpu_weights > 100, "weights resident: {}", info.gpu_weights);
    check(&mut inst, m, &some_cases());
}
