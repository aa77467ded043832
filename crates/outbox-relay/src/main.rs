//! The `outbox-relay` binary: see `outbox-relay --help`.

fn main() -> std::process::ExitCode {
    outbox_relay::cli::main()
}
