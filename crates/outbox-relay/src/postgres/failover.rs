//! Database failover: whether the slot survives the promotion of a standby.
//!
//! From PostgreSQL 17 a logical slot created with `failover = true`
//! (`postgres.failover_slot`) is copied to standbys that run with
//! `sync_replication_slots = on` (and `hot_standby_feedback = on`, a
//! `primary_slot_name`, a `dbname` in `primary_conninfo`); a promoted standby
//! has it, and the relay, following the URL's hosts with
//! `target_session_attrs=read-write`, streams from it on the new primary.
//! `synchronized_standby_slots` on the primary names the standbys' physical
//! slots that logical walsenders wait for: with it, the relay never receives
//! a transaction those standbys do not have, and their copy of the slot is
//! never behind what the relay confirmed. Without it a promotion may lose
//! transactions the relay already published, or give back a slot behind it
//! (repeats). What the primary cannot see is whether a standby really
//! synchronizes (`pg_replication_slots.synced` on the standby):
//! docs/recovery.md says how to look.

/// The slot and the server as failover sees them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// `server_version_num`.
    pub server_version: i32,
    /// The slot's `failover` flag (`None`: before 17, or no slot).
    pub failover: Option<bool>,
    /// `synchronized_standby_slots` (empty when unset or before 17).
    pub standby_slots: String,
    /// The slots it names that are not physical slots of this server: its
    /// logical walsenders wait for them forever.
    pub missing_standby_slots: Vec<String>,
}

impl State {
    /// Read it for `slot`.
    pub(crate) async fn read(
        client: &tokio_postgres::Client,
        slot: &str,
    ) -> Result<State, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('server_version_num')::int, \
                   (SELECT (to_jsonb(s) ->> 'failover')::bool FROM pg_replication_slots s WHERE s.slot_name = $1), \
                   coalesce(current_setting('synchronized_standby_slots', true), ''), \
                   coalesce((SELECT array_agg(name) FROM ( \
                       SELECT trim(name) AS name \
                       FROM unnest(string_to_array(coalesce(current_setting('synchronized_standby_slots', true), ''), ',')) AS name) n \
                     WHERE name NOT IN ('', '*') AND NOT EXISTS ( \
                       SELECT 1 FROM pg_replication_slots p \
                       WHERE p.slot_name = n.name AND p.slot_type = 'physical')), '{}')",
                &[&slot],
            )
            .await?;
        Ok(State {
            server_version: row.get(0),
            failover: row.get(1),
            standby_slots: row.get(2),
            missing_standby_slots: row.get(3),
        })
    }

    /// What is wrong for a relay that wants (`wanted`) or has a failover slot.
    pub(crate) fn problem(&self, wanted: bool) -> Option<Problem> {
        if wanted && self.server_version < 170_000 {
            return Some(Problem::Unsupported);
        }
        if !self.missing_standby_slots.is_empty() {
            return Some(Problem::StandbySlotMissing(
                self.missing_standby_slots.clone(),
            ));
        }
        match self.failover {
            Some(false) if wanted => Some(Problem::NotFailover),
            Some(true) if self.standby_slots.trim().is_empty() => Some(Problem::NoStandbyWaited),
            _ => None,
        }
    }

    /// One line for `status`.
    pub(crate) fn describe(&self) -> String {
        match self.failover {
            None if self.server_version < 170_000 => {
                "no failover slots before PostgreSQL 17".to_owned()
            }
            None => "no slot".to_owned(),
            Some(false) => "the slot is not a failover slot: a promoted standby will not have it".to_owned(),
            Some(true) if self.standby_slots.trim().is_empty() => {
                "failover slot; synchronized_standby_slots is empty (walsenders do not wait for standbys)"
                    .to_owned()
            }
            Some(true) => format!(
                "failover slot; walsenders wait for standby slots {}",
                self.standby_slots
            ),
        }
    }
}

/// What keeps the slot from surviving a failover.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Problem {
    /// `postgres.failover_slot` on a server before 17.
    Unsupported,
    /// `postgres.failover_slot`, but the slot was created without it.
    NotFailover,
    /// A failover slot, but no standby slot is waited for.
    NoStandbyWaited,
    /// `synchronized_standby_slots` names slots this server does not have
    /// (e.g. a promoted standby that kept its old primary's setting): its
    /// logical walsenders wait for them, and the relay receives nothing.
    StandbySlotMissing(Vec<String>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_state_has_its_problem() {
        let state = |version, failover, standby: &str| State {
            server_version: version,
            failover,
            standby_slots: standby.into(),
            missing_standby_slots: Vec::new(),
        };
        let gone = State {
            missing_standby_slots: vec!["standby1".into()],
            ..state(170_002, Some(true), "standby1")
        };
        assert_eq!(
            gone.problem(false),
            Some(Problem::StandbySlotMissing(vec!["standby1".into()]))
        );
        assert_eq!(
            state(160_004, None, "").problem(true),
            Some(Problem::Unsupported)
        );
        assert_eq!(state(160_004, None, "").problem(false), None);
        assert_eq!(
            state(170_002, Some(false), "").problem(true),
            Some(Problem::NotFailover)
        );
        assert_eq!(state(170_002, Some(false), "").problem(false), None);
        assert_eq!(
            state(170_002, Some(true), "").problem(false),
            Some(Problem::NoStandbyWaited)
        );
        assert_eq!(state(180_001, Some(true), "standby1").problem(true), None);
        assert!(state(180_001, Some(true), "standby1")
            .describe()
            .contains("standby1"));
    }
}
