//! `outbox-relay check`: is this database ready for the relay, and if not, what to do.
//!
//! The findings are [`crate::postgres::readiness`]'s, the same `run` starts from:
//! what stops `run` is an error here, in the same words; what `run` waits
//! out, recovers from or warns about is a warning. Errors make the command
//! exit non-zero; warnings do not. A stall of the slot ([`crate::postgres::stall`], what
//! `run` logs and fails `/readyz` with) is a warning too.

use std::fmt;

use crate::config::Config;
pub use crate::postgres::readiness::Severity;
use crate::postgres::readiness::{self, Area, Effect};

/// One thing checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// How bad.
    pub severity: Severity,
    /// What was checked and what was found; for problems, how to fix it.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.severity {
            Severity::Ok => "ok     ",
            Severity::Warning => "warning",
            Severity::Error => "error  ",
        };
        write!(f, "{tag} {}", self.message)
    }
}

/// Run every check against the database: what is fine, then warnings, then errors.
pub async fn run(
    config: &Config,
    client: &tokio_postgres::Client,
) -> Result<Vec<Finding>, tokio_postgres::Error> {
    let ready = readiness::inspect(client, config).await?;
    let names = &ready.names;
    // An area is fine unless something in it keeps the relay from streaming.
    let fine = |area: Area| {
        !ready.problems.iter().any(|p| {
            p.area() == area && matches!(p.effect(), Effect::Stops | Effect::StopsUnlessRecreated)
        })
    };
    let mut out = Vec::new();
    let mut ok = |message: String| {
        out.push(Finding {
            severity: Severity::Ok,
            message,
        })
    };
    if fine(Area::Server) {
        ok(format!("wal_level = {}", ready.wal_level));
    }
    if let Some(view) = ready.slot.as_ref().filter(|_| fine(Area::Slot)) {
        ok(readiness::slot_summary(&ready, view));
    }
    if ready.table.is_some() && fine(Area::Publication) {
        ok(format!(
            "publication {:?} carries inserts into {}",
            names.publication, names.table
        ));
    }
    if ready.table.is_some() && fine(Area::Table) {
        ok(format!("table {} has the mapped columns", names.table));
    }
    if let Some(line) = readiness::lifecycle_summary(&ready).filter(|_| fine(Area::Table)) {
        ok(line);
    }
    let mut problems: Vec<Finding> = ready
        .problems
        .iter()
        .map(|p| Finding {
            severity: ready.severity(p),
            message: p.describe(names),
        })
        .collect();
    let standby_slot_missing = ready.problems.iter().any(|p| {
        matches!(
            p,
            readiness::Problem::Failover(crate::postgres::failover::Problem::StandbySlotMissing(_))
        )
    });
    let look = crate::postgres::stall::look(client, &config.postgres.slot).await?;
    problems.extend(
        crate::postgres::stall::diagnose(&look, config.stream.prepared_transaction_max_age)
            .into_iter()
            // One look; the missing standby slot is said above already.
            .filter(|s| s.lasting)
            .filter(|s| {
                !(s.cause == crate::postgres::stall::Cause::StandbySlot && standby_slot_missing)
            })
            .map(|s| Finding {
                severity: Severity::Warning,
                message: format!("stalled: {}", s.describe()),
            }),
    );
    // Stable: warnings, then errors, each in the order run meets them.
    problems.sort_by_key(|f| f.severity);
    out.extend(problems);
    Ok(out)
}
