//! `wisp`: run LLMs inside a WebAssembly component.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
