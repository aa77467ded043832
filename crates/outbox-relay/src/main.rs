//! The `outbox-relay` binary: see `outbox-relay --help`.

fn main() -> std::process::ExitCode {
    no_transparent_huge_pages();
    outbox_relay::main()
}

/// mimalloc: the relay allocates for every event (the envelope, its fields)
/// and every call (the request body, its signature, the parsed answer), from
/// the runtime's thread and the writer tasks alike. Against glibc's malloc,
/// mimalloc takes about 13% off the CPU a row of an SNS drain, for about
/// 8 MiB more peak RSS (docs/benchmarks.md, "Allocator").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transparent huge pages off for this process. Where the kernel backs every
/// anonymous mapping with them (`/sys/kernel/mm/transparent_hugepage/enabled`
/// = `always`), the allocator's memory is faulted in 2 MiB at a time and
/// stays resident, so the relay's peak RSS was 3–29 MiB higher for the same
/// work (the 200,000-row drain 20 ms from SNS: 65 and 77 MiB against 51 and
/// 58 MiB), with no CPU saved (docs/benchmarks.md). This is what mimalloc
/// does when `MIMALLOC_ALLOW_THP=0`; set here because its options are read
/// before `main`. A memory limit is what the relay's budgets are sized for
/// (`stream.max_in_flight_bytes`), so resident memory should follow use.
#[cfg(target_os = "linux")]
fn no_transparent_huge_pages() {
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments and only sets a flag
    // of this process; a kernel without it returns an error, ignored.
    #[allow(unsafe_code)]
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

#[cfg(not(target_os = "linux"))]
fn no_transparent_huge_pages() {}
