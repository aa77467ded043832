//! `outbox-relay status`: the slot's health, the oldest pending row, the rows
//! by state (on a table whose state is derived, pending = not derived
//! published: [`crate::postgres::outbox::derived`]), the failover state, the oldest prepared transaction and what
//! stalls the slot ([`crate::postgres::stall`], from the server: one look, so only
//! stalls one look can tell), as a table or JSON; exit 1, naming the
//! problems, when the relay is not healthy.

use std::process::ExitCode;

use super::{connect, EXIT_FAILURE};
use crate::config::Config;
use crate::postgres::failover;
use crate::postgres::monitor::{self, SlotLag};
use crate::postgres::outbox::derived::Reader;
use crate::postgres::outbox::table::Table;
use crate::postgres::stall::{self, PreparedXact, Stall};

/// Print the status; the exit code.
pub(super) async fn run(config: &Config, json: bool) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let status = match Status::read(&client, config).await {
        Ok(status) => status,
        Err(e) => {
            eprintln!("error: cannot read the slot: {}", crate::report::Chain(&e));
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let problems = status.problems(config);
    if json {
        status.print_json(config, &problems);
    } else {
        status.print_table(config, &problems);
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILURE)
    }
}

/// What one look at the server found.
struct Status {
    slot: SlotLag,
    /// Rows by publish state (a managed table only).
    counts: Vec<(String, i64)>,
    /// Age of the oldest PENDING row in seconds (a managed table with `created_at`).
    oldest_pending: Option<f64>,
    failover: failover::State,
    /// The stalls one look can tell ([`Stall::lasting`]).
    stalls: Vec<Stall>,
    /// The oldest prepared transaction of the slot's database.
    oldest_prepared: Option<PreparedXact>,
}

impl Status {
    /// Read it; only the slot is needed, the rest is shown when it can be read.
    async fn read(
        client: &tokio_postgres::Client,
        config: &Config,
    ) -> Result<Status, tokio_postgres::Error> {
        let slot = monitor::slot_lag(client, &config.postgres.slot).await?;
        let table = Table::inspect(client, config).await.ok().flatten();
        let (counts, oldest_pending) = match &table {
            Some(t) if t.managed => match Reader::of(client, config, t.derived).await {
                Ok(reader) => (
                    monitor::row_counts(client, t, reader.as_ref())
                        .await
                        .unwrap_or_default(),
                    oldest_pending(client, t, reader.as_ref()).await,
                ),
                Err(e) => {
                    eprintln!(
                        "warning: cannot read the position table, so not the rows by state: {}",
                        crate::report::Chain(&e)
                    );
                    (Vec::new(), None)
                }
            },
            _ => (Vec::new(), None),
        };
        let failover = failover::State::read(client, &config.postgres.slot)
            .await
            .unwrap_or_default();
        let look = stall::look(client, &config.postgres.slot)
            .await
            .unwrap_or_else(|e| {
                eprintln!(
                    "warning: cannot ask the server what the slot waits for: {}",
                    crate::report::Chain(&e)
                );
                stall::Look::default()
            });
        let stalls = stall::diagnose(&look, config.stream.prepared_transaction_max_age)
            .into_iter()
            .filter(|s| s.lasting)
            .collect();
        Ok(Status {
            slot,
            counts,
            oldest_pending,
            failover,
            stalls,
            oldest_prepared: look.prepared.into_iter().find(|p| p.here),
        })
    }

    /// What is not healthy, in words.
    fn problems(&self, config: &Config) -> Vec<String> {
        let max_lag = config.http.ready_max_lag_bytes;
        let mut problems = Vec::new();
        match self.slot.wal_status.as_str() {
            "missing" => problems.push(format!("slot {:?} does not exist", config.postgres.slot)),
            "lost" => problems.push("the slot is invalidated (wal_status = lost)".to_owned()),
            "unreserved" => problems
                .push("the slot is about to be invalidated (wal_status = unreserved)".to_owned()),
            _ => {}
        }
        if self.slot.wal_status != "missing" && self.slot.active_pid.is_none() {
            problems.push("no relay is streaming from the slot".to_owned());
        }
        problems.extend(
            self.stalls
                .iter()
                .map(|s| format!("stalled ({}): {}", s.cause.label(), s.describe())),
        );
        if self.slot.lag_bytes > max_lag {
            problems.push(format!(
                "lag {} bytes is over http.ready_max_lag_bytes ({max_lag})",
                self.slot.lag_bytes
            ));
        }
        problems
    }

    fn print_json(&self, config: &Config, problems: &[String]) {
        let value = serde_json::json!({
            "slot": config.postgres.slot,
            "wal_status": self.slot.wal_status,
            "active_pid": self.slot.active_pid,
            "confirmed_flush_lsn": self.slot.confirmed_flush_lsn,
            "lag_bytes": self.slot.lag_bytes,
            "lag_seconds": self.slot.flush_lag_seconds,
            "retained_wal_bytes": self.slot.retained_bytes,
            "safe_wal_size_bytes": self.slot.safe_wal_size,
            "oldest_pending_seconds": self.oldest_pending,
            "failover": self.failover.failover,
            "synchronized_standby_slots": self.failover.standby_slots,
            "oldest_prepared_transaction": self.oldest_prepared.as_ref().map(|p| serde_json::json!({
                "gid": p.gid,
                "database": p.database,
                "owner": p.owner,
                "age_seconds": p.age,
            })),
            "stalls": self.stalls.iter().map(|s| serde_json::json!({
                "cause": s.cause.label(),
                "subject": s.subject,
                "seconds": s.seconds,
                "message": s.message,
                "fix": s.fix,
            })).collect::<Vec<_>>(),
            "rows": self.counts.iter().map(|(s, n)| (s.clone(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
            "healthy": problems.is_empty(),
            "problems": problems,
        });
        println!("{value:#}");
    }

    fn print_table(&self, config: &Config, problems: &[String]) {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
        println!("slot                 {}", config.postgres.slot);
        println!("wal_status           {}", self.slot.wal_status);
        println!(
            "streaming (pid)      {}",
            opt(self.slot.active_pid.map(|p| p.to_string()))
        );
        println!(
            "confirmed_flush_lsn  {}",
            opt(self.slot.confirmed_flush_lsn.clone())
        );
        println!(
            "lag                  {} bytes, {} s",
            self.slot.lag_bytes,
            opt(self.slot.flush_lag_seconds.map(|s| format!("{s:.3}")))
        );
        println!("retained WAL         {} bytes", self.slot.retained_bytes);
        println!(
            "safe_wal_size        {}",
            if self.slot.safe_wal_size < 0 {
                "unlimited".to_owned()
            } else {
                format!("{} bytes", self.slot.safe_wal_size)
            }
        );
        println!("failover             {}", self.failover.describe());
        println!(
            "oldest PENDING row   {}",
            opt(self.oldest_pending.map(|s| format!("{s:.1} s")))
        );
        println!(
            "oldest prepared tx   {}",
            opt(self.oldest_prepared.as_ref().map(|p| format!(
                "{} (database {:?}, owner {:?}, prepared {} ago)",
                crate::postgres::sql::quote_literal(&p.gid),
                p.database,
                p.owner,
                stall::age(p.age)
            )))
        );
        for (state, n) in &self.counts {
            println!("rows {state:<15} {n}");
        }
        for p in problems {
            println!("problem              {p}");
        }
    }
}

/// Seconds since the oldest PENDING row was written (with a `reader`, the
/// oldest not derived published, not the oldest row ever written); `None`
/// without a `created_at` column or when it cannot be read.
async fn oldest_pending(
    client: &tokio_postgres::Client,
    table: &Table,
    reader: Option<&Reader>,
) -> Option<f64> {
    let created_at = table.created_at.as_deref()?;
    let pending = match reader {
        Some(reader) => reader.pending("o", &reader.ranges(client).await.ok()?),
        None => "o.publish_state = 'PENDING'".to_owned(),
    };
    client
        .query_one(
            &format!(
                "SELECT extract(epoch FROM now() - min(o.{created_at}))::float8 FROM {} AS o WHERE {pending}",
                table.qualified
            ),
            &[],
        )
        .await
        .ok()
        .and_then(|r| r.get(0))
}
