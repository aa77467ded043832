//! `outbox-relay status`: the slot's health, the oldest pending row, the rows
//! by state, the failover state, the oldest prepared transaction and what
//! stalls the slot ([`crate::postgres::stall`], from the server: one look, so only
//! stalls one look can tell), as a table or JSON; exit 1, naming the
//! problems, when the relay is not healthy.

use std::process::ExitCode;

use super::{connect, EXIT_FAILURE};
use crate::config::Config;

/// Print the status; the exit code.
pub(super) async fn run(config: &Config, json: bool) -> ExitCode {
    let client = match connect(config).await {
        Ok(c) => c,
        Err(code) => return code,
    };
    let slot = match crate::postgres::monitor::slot_lag(&client, &config.postgres.slot).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: cannot read the slot: {}", crate::report::Chain(&e));
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let table = crate::postgres::outbox::table::Table::inspect(&client, config)
        .await
        .ok()
        .flatten();
    let counts = match &table {
        Some(t) if t.managed => crate::postgres::monitor::row_counts(&client, t)
            .await
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let oldest_pending: Option<f64> = match &table {
        Some(t) if t.managed && t.created_at.is_some() => client
            .query_one(
                &format!(
                    "SELECT extract(epoch FROM now() - min({}))::float8 FROM {} WHERE publish_state = 'PENDING'",
                    t.created_at.as_deref().unwrap_or("created_at"),
                    t.qualified
                ),
                &[],
            )
            .await
            .ok()
            .and_then(|r| r.get(0)),
        _ => None,
    };
    let failover = crate::postgres::failover::State::read(&client, &config.postgres.slot)
        .await
        .unwrap_or_default();
    let look = crate::postgres::stall::look(&client, &config.postgres.slot)
        .await
        .unwrap_or_else(|e| {
            eprintln!(
                "warning: cannot ask the server what the slot waits for: {}",
                crate::report::Chain(&e)
            );
            crate::postgres::stall::Look::default()
        });
    let stalls: Vec<crate::postgres::stall::Stall> =
        crate::postgres::stall::diagnose(&look, config.stream.prepared_transaction_max_age)
            .into_iter()
            .filter(|s| s.lasting)
            .collect();
    let oldest_prepared = look.prepared.iter().find(|p| p.here);
    let max_lag = config.http.ready_max_lag_bytes;
    let mut problems = Vec::new();
    match slot.wal_status.as_str() {
        "missing" => problems.push(format!("slot {:?} does not exist", config.postgres.slot)),
        "lost" => problems.push("the slot is invalidated (wal_status = lost)".to_owned()),
        "unreserved" => problems
            .push("the slot is about to be invalidated (wal_status = unreserved)".to_owned()),
        _ => {}
    }
    if slot.wal_status != "missing" && slot.active_pid.is_none() {
        problems.push("no relay is streaming from the slot".to_owned());
    }
    problems.extend(
        stalls
            .iter()
            .map(|s| format!("stalled ({}): {}", s.cause.label(), s.describe())),
    );
    if slot.lag_bytes > max_lag {
        problems.push(format!(
            "lag {} bytes is over http.ready_max_lag_bytes ({max_lag})",
            slot.lag_bytes
        ));
    }
    if json {
        let value = serde_json::json!({
            "slot": config.postgres.slot,
            "wal_status": slot.wal_status,
            "active_pid": slot.active_pid,
            "confirmed_flush_lsn": slot.confirmed_flush_lsn,
            "lag_bytes": slot.lag_bytes,
            "lag_seconds": slot.flush_lag_seconds,
            "retained_wal_bytes": slot.retained_bytes,
            "safe_wal_size_bytes": slot.safe_wal_size,
            "oldest_pending_seconds": oldest_pending,
            "failover": failover.failover,
            "synchronized_standby_slots": failover.standby_slots,
            "oldest_prepared_transaction": oldest_prepared.map(|p| serde_json::json!({
                "gid": p.gid,
                "database": p.database,
                "owner": p.owner,
                "age_seconds": p.age,
            })),
            "stalls": stalls.iter().map(|s| serde_json::json!({
                "cause": s.cause.label(),
                "subject": s.subject,
                "seconds": s.seconds,
                "message": s.message,
                "fix": s.fix,
            })).collect::<Vec<_>>(),
            "rows": counts.iter().map(|(s, n)| (s.clone(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
            "healthy": problems.is_empty(),
            "problems": problems,
        });
        println!("{value:#}");
    } else {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
        println!("slot                 {}", config.postgres.slot);
        println!("wal_status           {}", slot.wal_status);
        println!(
            "streaming (pid)      {}",
            opt(slot.active_pid.map(|p| p.to_string()))
        );
        println!(
            "confirmed_flush_lsn  {}",
            opt(slot.confirmed_flush_lsn.clone())
        );
        println!(
            "lag                  {} bytes, {} s",
            slot.lag_bytes,
            opt(slot.flush_lag_seconds.map(|s| format!("{s:.3}")))
        );
        println!("retained WAL         {} bytes", slot.retained_bytes);
        println!(
            "safe_wal_size        {}",
            if slot.safe_wal_size < 0 {
                "unlimited".to_owned()
            } else {
                format!("{} bytes", slot.safe_wal_size)
            }
        );
        println!("failover             {}", failover.describe());
        println!(
            "oldest PENDING row   {}",
            opt(oldest_pending.map(|s| format!("{s:.1} s")))
        );
        println!(
            "oldest prepared tx   {}",
            opt(oldest_prepared.map(|p| format!(
                "{} (database {:?}, owner {:?}, prepared {} ago)",
                crate::postgres::sql::quote_literal(&p.gid),
                p.database,
                p.owner,
                crate::postgres::stall::age(p.age)
            )))
        );
        for (state, n) in &counts {
            println!("rows {state:<15} {n}");
        }
        for p in &problems {
            println!("problem              {p}");
        }
    }
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILURE)
    }
}
