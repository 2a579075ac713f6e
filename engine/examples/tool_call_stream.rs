//! What streaming a tool call costs the server per token: an output that is one call whose
//! argument is a long string (a file an agent writes through a tool), fed to the call
//! stream as the engine feeds it, 4 bytes a token, in each format, at three lengths.
//! Prints `name: value unit` lines; the cost per token should not grow with the length
//! (the stream reads each byte once). Then outputs a model should not write but may: long
//! runs of digits, of spaces, of a name's letters; their cost per token should not grow
//! with the length either.
//!
//! `cargo run --release -p infer-engine --example tool_call_stream`

use std::time::Instant;

use infer_engine::server::tool_parser::{CallStream, ToolCallParser, ToolParameters};

fn main() {
    let formats = [
        (
            ToolCallParser::Hermes,
            "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a.rs\", \"text\": \"",
            "\"}}\n</tool_call>",
        ),
        (
            ToolCallParser::Llama3Json,
            "{\"name\": \"write\", \"parameters\": {\"path\": \"a.rs\", \"text\": \"",
            "\"}}",
        ),
        (
            ToolCallParser::Mistral,
            "[TOOL_CALLS][{\"name\": \"write\", \"arguments\": {\"path\": \"a.rs\", \"text\": \"",
            "\"}}]",
        ),
        (
            ToolCallParser::Pythonic,
            "[write(path='a.rs', text='",
            "')]",
        ),
        (
            ToolCallParser::Qwen3Coder,
            "<tool_call>\n<function=write>\n<parameter=path>\na.rs\n</parameter>\n<parameter=text>\n",
            "\n</parameter>\n</function>\n</tool_call>",
        ),
    ];
    for (parser, head, tail) in formats {
        for kib in [16usize, 64, 256] {
            // Code with escapes in it, as JSON and Python write a file's lines.
            let line = "    let x = f(a, \\\"b\\\");\\n";
            let body = line.repeat(kib * 1024 / line.len());
            let text = format!("{head}{body}{tail}");
            let best = (0..5)
                .map(|_| {
                    let start = Instant::now();
                    let mut stream = CallStream::new(parser, true, Default::default());
                    let mut end = 0;
                    let mut arguments = String::new();
                    while end < text.len() {
                        end = (end + 4).min(text.len());
                        for entry in stream.advance(&text[..end], || "id".to_string()) {
                            arguments.push_str(entry["function"]["arguments"].as_str().unwrap());
                        }
                    }
                    // The whole call went out before the end, as the whole parse reads it.
                    let parsed = parser
                        .parse(&text, true, &ToolParameters::default())
                        .expect("a call");
                    assert_eq!(arguments, parsed.calls[0].1, "{parser:?}");
                    start.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let tokens = text.len().div_ceil(4);
            println!(
                "{}_{kib}kib_per_token: {:.3} us ({tokens} tokens, best of 5)",
                parser.name(),
                best * 1e6 / tokens as f64
            );
        }
    }
    let degenerate = [
        (
            ToolCallParser::Hermes,
            "digits",
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1",
            "0",
            "}}",
        ),
        (ToolCallParser::Hermes, "spaces", "<tool_call>", " ", "{}"),
        (ToolCallParser::Llama3Json, "spaces", "", " ", "{}"),
        (ToolCallParser::Pythonic, "digits", "[f(a=1", "0", ")]"),
        (ToolCallParser::Pythonic, "a_name", "[f(a", "a", "=1)]"),
        (
            ToolCallParser::Qwen3Coder,
            "a_long_value",
            "<function=f><parameter=a>",
            "<",
            "</parameter></function>",
        ),
    ];
    for (parser, what, head, unit, tail) in degenerate {
        for kib in [16usize, 64] {
            let text = format!("{head}{}{tail}", unit.repeat(kib * 1024));
            let start = Instant::now();
            let mut stream = CallStream::new(parser, true, Default::default());
            let mut end = 0;
            while end < text.len() {
                end = (end + 4).min(text.len());
                stream.advance(&text[..end], || "id".to_string());
            }
            let tokens = text.len().div_ceil(4);
            println!(
                "{}_{what}_{kib}kib_per_token: {:.3} us ({tokens} tokens)",
                parser.name(),
                start.elapsed().as_secs_f64() * 1e6 / tokens as f64
            );
        }
    }
}
