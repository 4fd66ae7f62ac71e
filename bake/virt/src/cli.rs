//! `wasi:cli`: an empty environment, no terminals, and an `exit` that traps.

use alloc::string::String;
use alloc::vec::Vec;

use crate::bindings::exports::wasi::cli::{
    environment, exit, terminal_input, terminal_output, terminal_stderr, terminal_stdin,
    terminal_stdout,
};
use crate::{Never, Virt};

/// Nothing: the guest's configuration came with `preload` and its requests come over HTTP.
impl environment::Guest for Virt {
    fn get_environment() -> Vec<(String, String)> {
        Vec::new()
    }

    fn get_arguments() -> Vec<String> {
        Vec::new()
    }

    fn initial_cwd() -> Option<String> {
        None
    }
}

/// A reactor such as the pre-initialized guest never exits: it serves each call and returns. A
/// call here is a bug in it, so it traps rather than pretend to end a process it does not own.
impl exit::Guest for Virt {
    fn exit(status: Result<(), ()>) {
        panic!("wasi:cli/exit called with {status:?}: a pre-initialized guest never exits");
    }

    fn exit_with_code(status_code: u8) {
        panic!("wasi:cli/exit called with code {status_code}: a pre-initialized guest never exits");
    }
}

/// A terminal input, of which there is none.
impl terminal_input::Guest for Virt {
    type TerminalInput = Never;
}

impl terminal_input::GuestTerminalInput for Never {}

/// A terminal output, of which there is none.
impl terminal_output::Guest for Virt {
    type TerminalOutput = Never;
}

impl terminal_output::GuestTerminalOutput for Never {}

/// Standard input is no terminal (a proxy host has none).
impl terminal_stdin::Guest for Virt {
    fn get_terminal_stdin() -> Option<terminal_input::TerminalInput> {
        None
    }
}

/// Standard output is no terminal.
impl terminal_stdout::Guest for Virt {
    fn get_terminal_stdout() -> Option<terminal_output::TerminalOutput> {
        None
    }
}

/// Standard error is no terminal.
impl terminal_stderr::Guest for Virt {
    fn get_terminal_stderr() -> Option<terminal_output::TerminalOutput> {
        None
    }
}
