"""Records how llama.cpp's server (`--jinja`) renders each family's own chat template, into
tests/chat/rendered.json; tests/tests/chat_jinja.rs holds wisp's rendering to it.

For each template of FAMILIES (written into tests/chat/templates),
a tiny GGUF with the family's BOS and EOS texts and the template (tests/chat/tiny_model.py) is
served by
`llama-server --jinja --chat-template-file T`, one server at a time, and each conversation of
CONVERSATIONS is POSTed to `/apply-template`, with and without the generation prompt.

llama.cpp renders `strftime_now` and its `date_string` and `datetime` variables from the clock,
with no way to fix the date: each case records the strings those gave (`dates`: format -> text),
and the test puts wisp's own date in their place.

    python3 tests/chat/record.py LLAMA_CPP_DIR [WISP_CACHE]
        # LLAMA_CPP_DIR: llama.cpp's source, built in build-cpu/ (e.g. /var/tmp/llama.cpp-0.3.36);
        # WISP_CACHE: where wisp::fetch keeps the GGUFs (~/.cache/wisp)
"""

import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import gguf

import tiny_model

HERE = pathlib.Path(__file__).resolve().parent

# Family, where its template comes from, BOS text, EOS text (the released GGUFs'). A source is
# a file of llama.cpp's models/templates; `test-chat-template.cpp:NAME`, a template of llama.cpp's
# tests/test-chat-template.cpp; or `gguf:FILE`, the `tokenizer.chat_template` of a GGUF that
# wisp::fetch caches (~/.cache/wisp); where that GGUF is not cached, the copy in templates/, if
# it is the text rendered.json recorded (its sha256).
FAMILIES = [
    ("llama3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("llama3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("llama3.3", "meta-llama-Llama-3.3-70B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>"),
    ("deepseek-r1-distill-llama", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja",
     "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"),
    ("mistral-7b-v0.2", "test-chat-template.cpp:mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)",
     "<s>", "</s>"),
    ("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>"),
    ("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "<s>", "</s>"),
    ("smollm2", "gguf:SmolLM2-135M-Instruct.Q4_1.gguf", "<|im_start|>", "<|im_end|>"),
    ("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", "<|begin_of_text|>", "<|im_end|>"),
    ("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "<|endoftext|>", "<|im_end|>"),
    ("qwen2.5-coder", "gguf:qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "<|endoftext|>", "<|im_end|>"),
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", "<|endoftext|>", "<|im_end|>"),
    ("gemma", "test-chat-template.cpp:google/gemma-7b-it", "<bos>", "<eos>"),
    ("gemma2", "google-gemma-2-2b-it.jinja", "<bos>", "<eos>"),
    ("phi3-mini", "test-chat-template.cpp:Phi-3-mini", "<s>", "<|endoftext|>"),
    ("phi3.5", "microsoft-Phi-3.5-mini-instruct.jinja", "<s>", "<|endoftext|>"),
    ("phi4", "test-chat-template.cpp:phi-4", "<|endoftext|>", "<|im_end|>"),
    ("granite3.0", "test-chat-template.cpp:ibm-granite/granite-3.0-8b-instruct", "<|end_of_text|>", "<|end_of_text|>"),
    ("granite3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja", "<|end_of_text|>", "<|end_of_text|>"),
    ("granite4.0", "ibm-granite-granite-4.0.jinja", "<|end_of_text|>", "<|end_of_text|>"),
    # A Llama 2 70B chat fine-tune: Meta's `[INST] <<SYS>>` template with one BOS up front and a
    # default system prompt (Meta's own Llama-2-chat template is not in llama.cpp's tree).
    ("vigogne-2", "test-chat-template.cpp:bofenghuang/vigogne-2-70b-chat", "<s>", "</s>"),
    ("ministral3-reasoning", "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "<s>", "</s>"),
]

TRICKY = ("Gr\u00fc\u00dfe, \u4e16\u754c \U0001f30d\n{{ not jinja }} {% raw %} {# nor this #}\n"
          "\"double\" and 'single' quotes, a back\\slash\n  indented\tand tabbed  ")
CONVERSATIONS = {
    "user": [("user", "Hello!")],
    "system_user": [("system", "You are a helpful assistant."), ("user", "What is 2 + 2?")],
    "multi_turn": [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke.")],
    "tricky": [("system", "Answer in  one line.\n"), ("user", TRICKY), ("assistant", " {\"a\": [1, 2]} \n"), ("user", "\u00e9\n\n")],
}

# Conversations with tools, as OpenAI's clients send them (a call's arguments as JSON text),
# rendered by the families whose templates write tools in a syntax wisp reads (the engine's
# `tool-syntax`); the others get wisp's own description of the tools, by design unlike
# llama.cpp's generic one.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"},
                                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time now, \u00e0 la minute",
       "parameters": {"type": "object", "properties": {}}}}
TOOL_CONVERSATIONS = {
    "tools_user": {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, NOW]},
    "tools_round": {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
        {"role": "assistant", "content": "18 C and cloudy."},
        {"role": "user", "content": "Thanks!"}], "tools": [WEATHER]},
}
TOOL_FAMILIES = {"qwen2.5": "hermes", "qwen2.5-coder": "hermes", "qwen3": "hermes", "granite4.0": "hermes",
                 "llama3.1": "llama3-json", "llama3.2": "llama3-json", "llama3.3": "llama3-json"}

# The formats llama.cpp's clock-given strings take: `date_string`, `datetime` (common/chat.cpp).
CLOCK_VARIABLES = {"date_string": "%d %b %Y", "datetime": "%b %d %Y"}


def clock_formats(source):
    """The strftime formats whose text a rendering of `source` may hold."""
    formats = set(re.findall(r"strftime_now\(\s*[\"']([^\"']*)[\"']\s*\)", source))
    formats |= {f for name, f in CLOCK_VARIABLES.items() if name in source}
    return sorted(formats)


def template_of(llama_cpp, cache, family, source):
    """(file name in tests/chat/templates, text, where it comes from) of a FAMILIES source."""
    if source.startswith("test-chat-template.cpp:"):
        name = source.split(":", 1)[1]
        path = llama_cpp / "tests" / "test-chat-template.cpp"
        found = re.search(r'/\* \.name= \*/ "' + re.escape(name) + r'",\s*/\* \.template_str= \*/ (?:u8)?"((?:[^"\\]|\\.)*)"',
                          path.read_text())
        if not found:
            raise RuntimeError(f"no template {name!r} in {path}")
        escapes = {"n": "\n", "t": "\t", '"': '"', "'": "'", "\\": "\\"}
        text = re.sub(r"\\(.)", lambda m: escapes[m.group(1)], found.group(1))
        return f"{family}.jinja", text, f"llama.cpp tests/test-chat-template.cpp, the case {name!r}"
    if source.startswith("gguf:"):
        name = source.split(":", 1)[1]
        origin = f"tokenizer.chat_template of {name} (wisp::fetch)"
        if not (cache / name).exists():
            return f"{family}.jinja", recorded_copy(family, origin), origin
        field = gguf.GGUFReader(str(cache / name)).fields["tokenizer.chat_template"]
        return f"{family}.jinja", bytes(field.parts[field.data[0]]).decode(), origin
    return source, (llama_cpp / "models" / "templates" / source).read_text(), f"llama.cpp models/templates/{source}"


def recorded_copy(family, origin):
    """The template of `family` in templates/, checked against the sha256 rendered.json recorded."""
    recorded = json.loads((HERE / "rendered.json").read_text())["families"]
    entry = next((f for f in recorded if f["family"] == family and f["origin"] == origin), None)
    copy = HERE / "templates" / f"{family}.jinja"
    if entry is None or not copy.exists():
        raise RuntimeError(f"{family}: {origin} is not cached and has no recorded copy")
    text = copy.read_text()
    if hashlib.sha256(text.encode()).hexdigest() != entry["template_sha256"]:
        raise RuntimeError(f"{family}: {copy} is not the template rendered.json recorded")
    print(f"{family}: the GGUF is not cached; using the recorded copy {copy.name}", file=sys.stderr)
    return text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/apply-template", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def serve(bin_dir, model, template, log):
    port = free_port()
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    server = subprocess.Popen(
        [str(bin_dir / "llama-server"), "--jinja", "--chat-template-file", str(template), "-m", str(model),
         "--port", str(port), "--host", "127.0.0.1", "-c", "256", "-t", "1", "--no-warmup"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return server, port
        except OSError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited ({server.returncode}) for {template.name}")
        time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"llama-server did not come up for {template.name}")


def main(llama_cpp, cache):
    bin_dir = llama_cpp / "build-cpu" / "bin"
    version = subprocess.run([str(bin_dir / "llama-server"), "--version"], env=dict(os.environ, LD_LIBRARY_PATH=str(bin_dir)),
                             capture_output=True, text=True).stderr.strip().splitlines()
    (HERE / "templates").mkdir(exist_ok=True)
    families, cases = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for family, source, bos, eos in FAMILIES:
            name, text, origin = template_of(llama_cpp, cache, family, source)
            template = HERE / "templates" / name
            template.write_text(text)
            model = tmp / f"{family}.gguf"
            tiny_model.write(model, bos, eos, text)
            families.append({"family": family, "template": name, "origin": origin,
                             "template_sha256": hashlib.sha256(text.encode()).hexdigest(), "bos_token": bos, "eos_token": eos})
            formats = clock_formats(text)
            with open(tmp / f"{family}.log", "w") as log:
                server, port = serve(bin_dir, model, template, log)
                try:
                    for conv_name, conv in CONVERSATIONS.items():
                        for gen in (True, False):
                            body = {"messages": [{"role": r, "content": c} for r, c in conv], "add_generation_prompt": gen}
                            before = {f: time.strftime(f) for f in formats}
                            prompt = post(port, body)["prompt"]
                            dates = {f: time.strftime(f) for f in formats}
                            if dates != before:
                                raise RuntimeError("the date changed while rendering: run again")
                            cases.append({"family": family, "conversation": conv_name, "messages": [list(m) for m in conv],
                                          "add_generation_prompt": gen, "dates": dates, "prompt": prompt})
                    tool_conversations = TOOL_CONVERSATIONS.items() if family in TOOL_FAMILIES else []
                    for conv_name, conv in tool_conversations:
                        for gen in (True, False):
                            before = {f: time.strftime(f) for f in formats}
                            prompt = post(port, dict(conv, add_generation_prompt=gen))["prompt"]
                            dates = {f: time.strftime(f) for f in formats}
                            if dates != before:
                                raise RuntimeError("the date changed while rendering: run again")
                            cases.append({"family": family, "conversation": conv_name, "request": conv, "tool_syntax": TOOL_FAMILIES[family],
                                          "add_generation_prompt": gen, "dates": dates, "prompt": prompt})
                finally:
                    server.kill()
                    server.wait()
            print(f"{family}: {origin}", file=sys.stderr)
    out = {
        "source": f"llama.cpp's llama-server --jinja, POST /apply-template ({' '.join(version)})",
        "model": "tests/chat/tiny_model.py with the family's BOS and EOS texts and template (add_bos_token, add_eos_token false)",
        "families": families,
        "cases": cases,
    }
    (HERE / "rendered.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else pathlib.Path.home() / ".cache" / "wisp")
