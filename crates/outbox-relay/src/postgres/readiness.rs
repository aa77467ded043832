//! Whether the database is ready for the relay: the server, the slot, the
//! outbox table and the publication, inspected in one place and judged once.
//!
//! [`inspect`] reads what the relay needs and returns every [`Problem`] it
//! finds. Each problem has one text ([`Problem::message`], [`Problem::fix`])
//! and one [`Effect`]: what `run` does about it at start-up. Both commands
//! read the same findings:
//!
//! * `run` ([`Readiness::admit`], used by `replication::session`) stops on
//!   the first problem that stops it, stands by while the slot is in use,
//!   and recreates a missing or invalidated slot only when
//!   `lifecycle.recreate_slot` may;
//! * `check` prints them as errors and warnings ([`Effect::severity`]), in
//!   the same words ([`Problem::describe`]).
//!
//! So `check` never passes what `run` refuses, and never fails what `run`
//! accepts. Columns of older majors are read through `to_jsonb(row) ->> …`,
//! which is NULL where the column does not exist (the relay supports
//! PostgreSQL 14–18).

use crate::config::{Config, OnPublished, TableName};
use crate::event::{MappingError, RowMapping};
use crate::postgres::lsn::{format_lsn, parse_lsn};
use crate::postgres::outbox::derived;
use crate::postgres::outbox::record::RecordError;
use crate::postgres::outbox::table::{dead_letter_table, Table, MANAGED};
use crate::postgres::platform::Platform;
use crate::postgres::sql::{qualified, quote_literal};
use crate::postgres::walstream::Protocol;

/// How bad a finding is, for `check`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Fine.
    Ok,
    /// Works, but probably not what was meant, or not yet.
    Warning,
    /// The relay cannot run like this.
    Error,
}

/// What `run` does about a [`Problem`] at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// It stops: a person must change something first.
    Stops,
    /// It stops, unless `lifecycle.recreate_slot` is set and a poller can
    /// publish what the slot held (the slot is missing or invalidated).
    StopsUnlessRecreated,
    /// It waits and tries again every few seconds (the slot is in use).
    StandsBy,
    /// It runs, and logs a warning.
    Warns,
}

impl Effect {
    /// How `check` reports it; `recreates`: whether `run` would recreate a
    /// lost slot (see [`Readiness::recreates`]).
    pub(crate) fn severity(self, recreates: bool) -> Severity {
        match self {
            Effect::Stops => Severity::Error,
            Effect::StopsUnlessRecreated if recreates => Severity::Warning,
            Effect::StopsUnlessRecreated => Severity::Error,
            Effect::StandsBy | Effect::Warns => Severity::Warning,
        }
    }

    /// Whether waiting may mend it (`RelayError::Unusable::transient`).
    pub(crate) fn transient(self) -> bool {
        self == Effect::StandsBy
    }

    /// Whether `lifecycle.recreate_slot` mends it (`RelayError::Unusable::lost`).
    pub(crate) fn lost(self) -> bool {
        self == Effect::StopsUnlessRecreated
    }
}

/// What a finding is about, for `check`'s ok lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Area {
    /// Server settings.
    Server,
    /// The replication slot.
    Slot,
    /// The outbox table.
    Table,
    /// The publication.
    Publication,
}

/// Something about the database that keeps the relay from running as configured.
#[derive(Debug)]
pub(crate) enum Problem {
    /// The server is a standby (in recovery): the relay writes (marking,
    /// recording, its position) and needs the primary.
    Standby,
    /// `wal_level` is not `logical`.
    WalLevel {
        /// Its value.
        level: String,
        /// Where the server runs: the fix is its setting.
        platform: Platform,
    },
    /// `postgres.slot` does not exist.
    SlotMissing,
    /// The slot is physical, or uses another output plugin.
    WrongPlugin {
        /// Its plugin; `None` for a physical slot.
        plugin: Option<String>,
    },
    /// The slot belongs to another database.
    OtherDatabase {
        /// The slot's database.
        database: String,
    },
    /// The slot is invalidated (`wal_status = lost`).
    Invalidated {
        /// `invalidation_reason` (PostgreSQL 17+), or `conflicting` on a 16 standby (on a 16
        /// primary `conflicting` is set for WAL removal too: no reason then);
        /// `None` where the server does not say (14–16: the WAL was removed).
        reason: Option<String>,
    },
    /// The slot would not survive a database failover
    /// ([`crate::postgres::failover`]).
    Failover(crate::postgres::failover::Problem),
    /// Another backend streams from the slot.
    Busy {
        /// Its process id.
        pid: i32,
    },
    /// The slot has no confirmed position to start from.
    NoConfirmedPosition,
    /// The table does not exist.
    TableMissing,
    /// The table does not fit `[columns]`.
    Mapping(MappingError),
    /// An optional mapped column is not in the table.
    OptionalColumnMissing {
        /// The `columns.*` key.
        key: &'static str,
        /// The configured column.
        column: String,
    },
    /// Mark (or derive) mode without the relay-managed columns.
    ManagedColumnsMissing {
        /// `lifecycle.on_published`.
        mode: OnPublished,
    },
    /// `lifecycle.on_published = "derive"`, but the table or the position
    /// table lacks what it needs: the relay runs as `mark`
    /// ([`Readiness::runs_as_mark`], which `run` decides by at start).
    DerivedRunsAsMark {
        /// What is missing, one phrase each.
        missing: Vec<String>,
    },
    /// The derived lifecycle's column has no default, or another one than
    /// `pg_current_xact_id()`.
    TxidDefault {
        /// The default, when there is one.
        default: Option<String>,
    },
    /// The derived lifecycle's indexes (`<table>_txid_idx`,
    /// `<table>_explicit_idx`) are missing or invalid.
    DerivedIndexMissing {
        /// Their names.
        indexes: Vec<String>,
    },
    /// Roles other than the relays, the owner, the bootstrap superuser and
    /// the role checking may set the derived lifecycle's column: by a
    /// table-level INSERT or UPDATE, or a column grant on it, or bypassing
    /// column privileges (superusers, members of `pg_write_all_data`,
    /// members of the owner's role).
    TxidForgeable {
        /// The roles granted it (`PUBLIC` for everyone).
        roles: Vec<String>,
        /// The roles that bypass column privileges, each with why:
        /// `name (superuser)`, `name (member of pg_write_all_data)`,
        /// `name (member of the owner <owner>)`.
        bypassing: Vec<String>,
    },
    /// The table or partitions of it write no WAL (`UNLOGGED`, or foreign
    /// tables): their rows are never streamed, so the derived lifecycle
    /// vouches for nothing new while they exist
    /// ([`crate::postgres::outbox::derived::publication_identity`]).
    NotLogged {
        /// Each, with why (`name (unlogged)`, `name (foreign)`).
        relations: Vec<String>,
    },
    /// Roles besides the relays may write the position table, whose row
    /// says what the relay delivered: such a role can make the relay vouch
    /// for rows it never sent (a moved confirmed position, emptied holes).
    PositionWritable {
        /// The position table, schema-qualified.
        position: String,
        /// The roles granted a write (`PUBLIC` for everyone).
        roles: Vec<String>,
    },
    /// The trigger that clears the id of a row set back to `PENDING` by hand
    /// (`<table>_requeue`, sql/009_state_view.sql) is missing, disabled, or
    /// does not fire in every session (`ENABLE ALWAYS`): such a row would
    /// keep its id, read as published and never be sent again.
    RequeueTrigger {
        /// The trigger's name.
        trigger: String,
        /// Each relation where it does not fire always, with how it stands.
        relations: Vec<String>,
    },
    /// Other publications send the derived lifecycle's column (PostgreSQL
    /// 15+, where column lists can leave it out).
    TxidPublished {
        /// The publications.
        publications: Vec<String>,
    },
    /// Neither the relay-managed columns nor a dead-letter table: a rejected
    /// event would have nowhere to be recorded.
    NowhereToRecord {
        /// The dead-letter table looked for, quoted.
        dead_letter: String,
    },
    /// The table has the relay-managed columns but there is no dead-letter
    /// table: a rejected event whose row is gone would stop the relay.
    NoDeadLetterTable {
        /// The dead-letter table looked for, quoted.
        dead_letter: String,
    },
    /// There is no position table the relay may write
    /// ([`crate::postgres::position`]): after a PostgreSQL crash or fast restart the
    /// relay may publish again what it had published.
    NoPositionTable {
        /// The position table looked for, quoted.
        position: String,
    },
    /// `postgres.publication` does not exist.
    PublicationMissing,
    /// The table is partitioned and the publication sends its partitions
    /// under their own names.
    NotViaRoot,
    /// The publication does not carry the table.
    TableNotPublished,
    /// The publication does not publish inserts.
    NoInserts,
    /// The publication filters the table's rows.
    RowFilter {
        /// The filter.
        filter: String,
    },
    /// The publication's column list leaves out mapped columns.
    ColumnList {
        /// The mapped columns it leaves out.
        columns: Vec<String>,
        /// Whether one of them is required (`run` stops) or all are optional
        /// (`run` warns).
        required: bool,
    },
}

/// The names the texts use.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// `postgres.slot`.
    pub slot: String,
    /// `postgres.publication`.
    pub publication: String,
    /// `postgres.table`.
    pub table: TableName,
    /// The database connected to.
    pub database: String,
}

impl Problem {
    /// What `run` does about it.
    pub(crate) fn effect(&self) -> Effect {
        match self {
            Problem::SlotMissing | Problem::Invalidated { .. } => Effect::StopsUnlessRecreated,
            Problem::Busy { .. } => Effect::StandsBy,
            Problem::OptionalColumnMissing { .. }
            | Problem::NoDeadLetterTable { .. }
            | Problem::NoPositionTable { .. }
            | Problem::DerivedRunsAsMark { .. }
            | Problem::TxidDefault { .. }
            | Problem::DerivedIndexMissing { .. }
            | Problem::TxidForgeable { .. }
            | Problem::TxidPublished { .. }
            | Problem::RequeueTrigger { .. }
            | Problem::PositionWritable { .. }
            | Problem::NotLogged { .. }
            | Problem::Failover(_) => Effect::Warns,
            Problem::ColumnList { required, .. } => {
                if *required {
                    Effect::Stops
                } else {
                    Effect::Warns
                }
            }
            Problem::WalLevel { .. }
            | Problem::Standby
            | Problem::WrongPlugin { .. }
            | Problem::OtherDatabase { .. }
            | Problem::NoConfirmedPosition
            | Problem::TableMissing
            | Problem::Mapping(_)
            | Problem::ManagedColumnsMissing { .. }
            | Problem::NowhereToRecord { .. }
            | Problem::PublicationMissing
            | Problem::NotViaRoot
            | Problem::TableNotPublished
            | Problem::NoInserts
            | Problem::RowFilter { .. } => Effect::Stops,
        }
    }

    /// What it is about.
    pub(crate) fn area(&self) -> Area {
        match self {
            Problem::WalLevel { .. } | Problem::Standby => Area::Server,
            Problem::SlotMissing
            | Problem::WrongPlugin { .. }
            | Problem::OtherDatabase { .. }
            | Problem::Invalidated { .. }
            | Problem::Failover(_)
            | Problem::Busy { .. }
            | Problem::NoConfirmedPosition => Area::Slot,
            Problem::TableMissing
            | Problem::Mapping(_)
            | Problem::OptionalColumnMissing { .. }
            | Problem::ManagedColumnsMissing { .. }
            | Problem::NowhereToRecord { .. }
            | Problem::NoDeadLetterTable { .. }
            | Problem::NoPositionTable { .. }
            | Problem::DerivedRunsAsMark { .. }
            | Problem::TxidDefault { .. }
            | Problem::DerivedIndexMissing { .. }
            | Problem::TxidForgeable { .. }
            | Problem::PositionWritable { .. }
            | Problem::RequeueTrigger { .. }
            | Problem::NotLogged { .. } => Area::Table,
            Problem::PublicationMissing
            | Problem::TxidPublished { .. }
            | Problem::NotViaRoot
            | Problem::TableNotPublished
            | Problem::NoInserts
            | Problem::RowFilter { .. }
            | Problem::ColumnList { .. } => Area::Publication,
        }
    }

    /// What is wrong.
    pub(crate) fn message(&self, at: &Names) -> String {
        let Names {
            slot,
            publication,
            table,
            database,
        } = at;
        match self {
            Problem::WalLevel { level, .. } => format!(
                "wal_level = {level}; logical replication needs wal_level = logical"
            ),
            Problem::Standby => "the server is a standby (in recovery); the relay writes to the \
                 database (marking, recording rejected events, its position) and streams from the \
                 primary"
                .to_owned(),
            Problem::SlotMissing => format!("replication slot {slot:?} does not exist"),
            Problem::WrongPlugin { plugin } => format!(
                "replication slot {slot:?} uses plugin {:?}; the relay needs a logical slot with plugin pgoutput",
                plugin.as_deref().unwrap_or("none (a physical slot)")
            ),
            Problem::OtherDatabase { database: other } => format!(
                "replication slot {slot:?} belongs to database {other:?}, not {database:?}"
            ),
            Problem::Invalidated { reason } => format!(
                "replication slot {slot:?} is invalidated (wal_status = lost): {}",
                invalidation(reason.as_deref())
            ),
            Problem::Busy { pid } => format!(
                "replication slot {slot:?} is in use by backend PID {pid} (another relay?)"
            ),
            Problem::NoConfirmedPosition => {
                format!("replication slot {slot:?} has no confirmed_flush_lsn")
            }
            Problem::TableMissing => format!("table {table} does not exist (postgres.table)"),
            // The mapping's own words, as the stream gives them.
            Problem::Mapping(e) => e.to_string(),
            Problem::OptionalColumnMissing { key, column } => {
                format!("table {table} has no column {column:?} (columns.{key})")
            }
            Problem::ManagedColumnsMissing { mode } => format!(
                "lifecycle.on_published = \"{}\" needs the relay-managed columns ({}) in table {table}",
                mode_name(*mode),
                MANAGED.join(", ")
            ),
            Problem::DerivedRunsAsMark { missing } => format!(
                "lifecycle.on_published = \"derive\" runs as \"mark\" (one UPDATE per published row): {}",
                missing.join("; ")
            ),
            Problem::TxidDefault { default: None } => format!(
                "column {col} of table {table} has no default: new rows carry no transaction id, so \
                 none is derived published; the poller publishes them after its grace and each is \
                 updated, as under \"mark\"",
                col = derived::COLUMN
            ),
            Problem::TxidDefault {
                default: Some(default),
            } => format!(
                "column {col} of table {table} has the default {default}, not pg_current_xact_id(): \
                 a row whose id is not its transaction's could read as published without having been",
                col = derived::COLUMN
            ),
            Problem::DerivedIndexMissing { indexes } => format!(
                "table {table} has no valid index {}: the poller, retention and status scan the \
                 whole table for the rows they look for",
                indexes.join(", ")
            ),
            Problem::TxidForgeable { roles, bypassing } => {
                let col = derived::COLUMN;
                let mut who = Vec::new();
                if !roles.is_empty() {
                    who.push(format!(
                        "{} {} may set {col} in table {table} (a table-level INSERT or UPDATE, \
                         which a column REVOKE does not narrow, a grant on the column, or TRIGGER, \
                         on the table or on a partition, where an insert is checked against the \
                         partition's privileges alone)",
                        if roles.len() == 1 { "role" } else { "roles" },
                        roles.join(", "),
                    ));
                }
                if !bypassing.is_empty() {
                    who.push(format!(
                        "{} {} {} column privileges and may set {col} in table {table} whatever \
                         is granted: they must be trusted application code or not write the outbox",
                        if bypassing.len() == 1 { "role" } else { "roles" },
                        bypassing.join(", "),
                        if bypassing.len() == 1 { "bypasses" } else { "bypass" },
                    ));
                }
                format!(
                    "{}: a row with a forged id could read as published without having been sent",
                    who.join("; ")
                )
            }
            Problem::NotLogged { relations } => format!(
                "{} of table {table} {} no WAL: {} rows are never streamed, so \
                 lifecycle.on_published = \"derive\" vouches for nothing new while {} (every \
                 published row is updated, as under \"mark\"; the poller publishes theirs)",
                relations.join(", "),
                if relations.len() == 1 { "writes" } else { "write" },
                if relations.len() == 1 { "its" } else { "their" },
                if relations.len() == 1 { "it does" } else { "they do" },
            ),
            Problem::PositionWritable { position, roles } => format!(
                "{} {} may write table {position}, whose row says what the relay delivered: a \
                 moved confirmed_lsn or emptied holes there make the relay vouch for rows it never \
                 sent, and they read as published",
                if roles.len() == 1 { "role" } else { "roles" },
                roles.join(", ")
            ),
            Problem::RequeueTrigger { trigger, relations } => format!(
                "trigger {trigger} does not fire on every update that sets a row of table {table} \
                 back to PENDING ({}): such a row keeps its {col}, reads as published and is never \
                 sent again",
                relations.join(", "),
                col = derived::COLUMN,
            ),
            Problem::TxidPublished { publications } => format!(
                "{} {} {} table {table} with its column {col}: a subscriber receives this \
                 server's transaction ids, which mean nothing there (its copy would read as \
                 published or not by another server's transactions)",
                if publications.len() == 1 { "publication" } else { "publications" },
                publications.join(", "),
                if publications.len() == 1 { "publishes" } else { "publish" },
                col = derived::COLUMN
            ),
            // The recorder's own words.
            Problem::NowhereToRecord { dead_letter } => RecordError::Nowhere {
                table: table.to_string(),
                dead_letter: dead_letter.clone(),
            }
            .to_string(),
            Problem::NoDeadLetterTable { dead_letter } => format!(
                "there is no {dead_letter} table: a rejected event whose row is gone (deleted in its \
                 own transaction) could not be recorded, and the relay would stop at it"
            ),
            Problem::Failover(crate::postgres::failover::Problem::Unsupported) => {
                "postgres.failover_slot is set, but failover slots came with PostgreSQL 17: a promoted \
                 standby of this server will not have the slot"
                    .to_owned()
            }
            Problem::Failover(crate::postgres::failover::Problem::NotFailover) => format!(
                "postgres.failover_slot is set, but replication slot {slot:?} was created without \
                 failover: a promoted standby will not have it"
            ),
            Problem::Failover(crate::postgres::failover::Problem::NoStandbyWaited) => format!(
                "replication slot {slot:?} is a failover slot, but synchronized_standby_slots is empty: \
                 the relay may publish a transaction a standby does not have yet, and a promoted \
                 standby's copy of the slot may be behind what the relay confirmed"
            ),
            Problem::Failover(crate::postgres::failover::Problem::StandbySlotMissing(missing)) => format!(
                "synchronized_standby_slots names {} that this server does not have as physical \
                 slots: its logical walsenders wait for them, and the relay receives nothing",
                missing.join(", ")
            ),
            Problem::NoPositionTable { position } => format!(
                "there is no {position} table the relay may write: after a crash or a fast restart \
                 of PostgreSQL the slot can come back behind what the relay confirmed, and those \
                 events would be published again"
            ),
            Problem::PublicationMissing => format!("publication {publication:?} does not exist"),
            Problem::NotViaRoot => format!(
                "table {table} is partitioned but publication {publication:?} publishes its partitions \
                 under their own names"
            ),
            Problem::TableNotPublished => format!(
                "publication {publication:?} does not carry table {table} (postgres.table)"
            ),
            Problem::NoInserts => format!("publication {publication:?} does not publish inserts"),
            Problem::RowFilter { filter } => format!(
                "publication {publication:?} has a row filter on {table} (WHERE {filter}): rows it \
                 filters out would never be published"
            ),
            Problem::ColumnList { columns, .. } => format!(
                "publication {publication:?} has a column list on {table} that leaves out the mapped \
                 column(s) {}",
                columns.join(", ")
            ),
        }
    }

    /// How to fix it; `None` when [`message`](Self::message) says it already.
    pub(crate) fn fix(&self, at: &Names) -> Option<String> {
        let Names {
            slot,
            publication,
            table,
            ..
        } = at;
        let recreate = format!(
            "SELECT pg_drop_replication_slot('{slot}'), then SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        );
        Some(match self {
            Problem::WalLevel { platform, .. } => platform.logical_decoding_fix(),
            Problem::Standby => "point postgres.url at the primary, or list every host with \
                 target_session_attrs=read-write so the relay finds the primary among them"
                .to_owned(),
            Problem::SlotMissing => format!(
                "create it with `outbox-relay setup --config FILE --apply`, or run \
                 SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput'), or set \
                 lifecycle.recreate_slot = true; rows written meanwhile are in the table for the poller"
            ),
            Problem::WrongPlugin { .. } => format!("drop it and create it with pgoutput: {recreate}"),
            Problem::OtherDatabase { .. } => {
                "point postgres.url at that database or set postgres.slot to a slot of this one".into()
            }
            Problem::Invalidated { .. } => "drop and recreate it (or set lifecycle.recreate_slot = true); \
                 rows written meanwhile are still in the table for the poller"
                .into(),
            Problem::Busy { .. } => "a relay stands by and takes over when it is free".into(),
            Problem::NoConfirmedPosition => format!("drop it and recreate it: {recreate}"),
            Problem::TableMissing => {
                "create it with `outbox-relay setup --config FILE --apply`".into()
            }
            Problem::Mapping(_) | Problem::NowhereToRecord { .. } => return None,
            Problem::NoDeadLetterTable { .. } => {
                "create it with `outbox-relay setup --config FILE --apply` (sql/005_dead_letter.sql)".into()
            }
            Problem::Failover(crate::postgres::failover::Problem::Unsupported) => {
                "upgrade to PostgreSQL 17 or later, or set postgres.failover_slot = false and \
                 recreate the slot after a failover (docs/recovery.md)"
                    .into()
            }
            Problem::Failover(crate::postgres::failover::Problem::NotFailover) => format!(
                "make it one on a replication connection: psql \"dbname=… replication=database\" -c \
                 'ALTER_REPLICATION_SLOT {slot} (FAILOVER true)' (docs/recovery.md)"
            ),
            Problem::Failover(crate::postgres::failover::Problem::NoStandbyWaited) => {
                "set synchronized_standby_slots on the primary to the standbys' physical slots \
                 (docs/recovery.md, database failover)"
                    .into()
            }
            Problem::Failover(crate::postgres::failover::Problem::StandbySlotMissing(_)) => {
                "set synchronized_standby_slots to this server's standbys' physical slots, or empty \
                 it (a promoted standby keeps its old primary's setting)"
                    .into()
            }
            Problem::NoPositionTable { .. } => {
                "create it with `outbox-relay setup --config FILE --apply` (sql/006_position.sql), \
                 which also grants the relay's role INSERT and UPDATE on it"
                    .into()
            }
            Problem::OptionalColumnMissing { key, .. } => {
                format!("set columns.{key} = \"\" if that is intended")
            }
            Problem::ManagedColumnsMissing { .. } => {
                "add them (see sql/001_outbox_table.sql), or set lifecycle.on_published = \"none\" \
                 (application-managed table) or \"delete\""
                    .into()
            }
            Problem::DerivedRunsAsMark { .. } => {
                "add what is missing online with `outbox-relay setup --config FILE --apply` \
                 (docs/operations.md, migration), or set lifecycle.on_published = \"mark\""
                    .into()
            }
            Problem::TxidDefault { .. } => format!(
                "ALTER TABLE {table} ALTER COLUMN {col} SET DEFAULT pg_current_xact_id(), or run \
                 `outbox-relay setup --config FILE --apply`",
                col = derived::COLUMN
            ),
            Problem::DerivedIndexMissing { .. } => {
                "build them online with `outbox-relay setup --config FILE --apply` (CREATE INDEX \
                 CONCURRENTLY, sql/008_derived_indexes.sql)"
                    .into()
            }
            Problem::TxidForgeable { roles, bypassing } => {
                let mut fixes = Vec::new();
                if !roles.is_empty() {
                    fixes.push(
                        "grant the application its own columns instead: `outbox-relay setup \
                         --config FILE --apply --producer-role ROLE` (sql/010_producer.sql)",
                    );
                }
                if !bypassing.is_empty() {
                    fixes.push(
                        "take from a role that is not trusted what lets it bypass them (ALTER \
                         ROLE name NOSUPERUSER, REVOKE pg_write_all_data FROM name, REVOKE \
                         owner_role FROM name)",
                    );
                }
                format!("{} (docs/producers.md)", fixes.join("; "))
            }
            Problem::NotLogged { .. } => "ALTER TABLE name SET LOGGED (a foreign table: detach it \
                 from the outbox), then restart the relay (docs/guarantees.md)"
                .into(),
            Problem::PositionWritable { position, roles } => format!(
                "REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON {position} FROM {} (only the relay \
                 writes it; skip a backlog with pg_replication_slot_advance or `outbox-relay \
                 replay`, never by editing the row: docs/guarantees.md)",
                roles.join(", ")
            ),
            Problem::RequeueTrigger { trigger, .. } => format!(
                "run `outbox-relay setup --config FILE --apply` again (it creates the trigger and \
                 enables it ALWAYS, so that it fires under session_replication_role = replica too), \
                 or ALTER TABLE {table} ENABLE ALWAYS TRIGGER {trigger}; `DISABLE TRIGGER ALL` \
                 turns it off as well (docs/guarantees.md)"
            ),
            Problem::TxidPublished { .. } => format!(
                "give each a column list without it: ALTER PUBLICATION name SET TABLE {table} \
                 (column, ...) (docs/producers.md)"
            ),
            Problem::PublicationMissing => format!(
                "run `outbox-relay setup --config FILE --apply` or CREATE PUBLICATION {publication} \
                 FOR TABLE {table} WITH (publish = 'insert', publish_via_partition_root = true)"
            ),
            Problem::NotViaRoot => format!(
                "ALTER PUBLICATION {publication} SET (publish_via_partition_root = true)"
            ),
            Problem::TableNotPublished => format!("ALTER PUBLICATION {publication} ADD TABLE {table}"),
            Problem::NoInserts => format!("ALTER PUBLICATION {publication} SET (publish = 'insert')"),
            Problem::RowFilter { .. } => format!(
                "drop the filter (ALTER PUBLICATION {publication} SET TABLE {table}); the relay's \
                 [filter] can skip events instead, and marks them SKIPPED"
            ),
            Problem::ColumnList { .. } => format!(
                "drop the column list (ALTER PUBLICATION {publication} SET TABLE {table})"
            ),
        })
    }

    /// The message and the fix: what `run` stops with and `check` prints.
    pub(crate) fn describe(&self, at: &Names) -> String {
        match self.fix(at) {
            Some(fix) => format!("{}: {fix}", self.message(at)),
            None => self.message(at),
        }
    }
}

/// `lifecycle.on_published`'s value for `mode`.
fn mode_name(mode: OnPublished) -> &'static str {
    match mode {
        OnPublished::Derive => "derive",
        OnPublished::Mark => "mark",
        OnPublished::Delete => "delete",
        OnPublished::None => "none",
    }
}

/// The lifecycle `run` keeps rows by, for `check`'s line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    /// As configured (for `derive`: the table and the position table have
    /// what it needs).
    AsConfigured(OnPublished),
    /// `derive` is configured but runs as `mark`
    /// ([`Problem::DerivedRunsAsMark`] says why).
    DeriveAsMark,
}

/// The roles every table has that may set any of its columns whatever is
/// granted ([`Readiness::txid_unbound`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unbound {
    /// The table's owner.
    pub owner: String,
    /// The cluster's bootstrap superuser (the role `initdb` made; on a
    /// managed service, the provider's).
    pub bootstrap: String,
}

impl Unbound {
    /// Who they are, for `check`'s line.
    fn describe(&self) -> String {
        let col = derived::COLUMN;
        let who = if self.owner == self.bootstrap {
            format!("the owner {}, the bootstrap superuser,", self.owner)
        } else {
            format!(
                "the owner {} and the bootstrap superuser {}",
                self.owner, self.bootstrap
            )
        };
        format!(
            "{who} bypass column privileges and may set {col}: they must be trusted application \
             code or not write the outbox"
        )
    }
}

/// `check`'s ok line for the lifecycle in force, `None` when `derive` runs
/// as `mark` (a warning says so) or the table does not exist.
pub(crate) fn lifecycle_summary(ready: &Readiness) -> Option<String> {
    let Names { table, .. } = &ready.names;
    let position = crate::postgres::position::table_name(&table.name);
    Some(match ready.lifecycle? {
        Lifecycle::DeriveAsMark => return None,
        Lifecycle::AsConfigured(OnPublished::Derive) => format!(
            "lifecycle derive: table {table} has {col} DEFAULT pg_current_xact_id() and its \
             indexes, and {position:?} is writable: a row is published once its transaction is \
             in a snapshot the relay vouched for, without being written again{unbound}",
            col = derived::COLUMN,
            unbound = ready
                .txid_unbound
                .as_ref()
                .map(|u| format!("; {}", u.describe()))
                .unwrap_or_default()
        ),
        Lifecycle::AsConfigured(OnPublished::Mark) => {
            "lifecycle mark (lifecycle.on_published): each published row is updated".to_owned()
        }
        Lifecycle::AsConfigured(OnPublished::Delete) => {
            "lifecycle delete (lifecycle.on_published): each published row is deleted".to_owned()
        }
        Lifecycle::AsConfigured(OnPublished::None) => {
            "lifecycle none (lifecycle.on_published): the table is left alone".to_owned()
        }
    })
}

/// Why a slot was invalidated, from `invalidation_reason`.
fn invalidation(reason: Option<&str>) -> String {
    match reason {
        None | Some("wal_removed") => "the WAL it needed was removed (it fell further behind than \
             max_slot_wal_keep_size allows)"
            .into(),
        Some("rows_removed") => {
            "the catalog rows it needed were removed by VACUUM (rows_removed; on a \
             standby, hot_standby_feedback keeps them)"
                .into()
        }
        Some("wal_level_insufficient") => {
            "wal_level on the primary was lowered below logical (wal_level_insufficient)".into()
        }
        Some("idle_timeout") => {
            "it was unused for longer than idle_replication_slot_timeout (idle_timeout)".into()
        }
        Some(CONFLICTING) => "it conflicted with recovery on this standby (rows_removed or \
             wal_level_insufficient)"
            .into(),
        Some(other) => format!("invalidation_reason = {other}"),
    }
}

/// The first `server_version_num` whose pgoutput decodes prepared
/// transactions (`two_phase`, protocol version 3).
pub(crate) const TWO_PHASE_PGOUTPUT: i32 = 150_000;

/// What PostgreSQL 16 says of an invalidated slot in place of a reason.
const CONFLICTING: &str = "conflicting";

/// What the slot looks like, as far as the relay cares.
#[derive(Debug, Clone)]
pub(crate) struct SlotView {
    /// Position confirmed by the consumer.
    pub confirmed_flush: Option<u64>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Created with `two_phase` (prepared transactions are decoded at
    /// PREPARE TRANSACTION, from PostgreSQL 15 on).
    pub two_phase: bool,
}

/// Everything [`inspect`] found.
#[derive(Debug)]
pub(crate) struct Readiness {
    /// The names the texts use.
    pub names: Names,
    /// `wal_level`.
    pub wal_level: String,
    /// `server_version_num`, e.g. 150004.
    pub server_version_num: i32,
    /// The slot, when it exists.
    pub slot: Option<SlotView>,
    /// The table, when it exists.
    pub table: Option<Table>,
    /// The lifecycle in force, when the table exists.
    pub lifecycle: Option<Lifecycle>,
    /// Under `derive`, the roles that may always set the derived
    /// lifecycle's column, bound by no privilege: the table's owner and the
    /// bootstrap superuser (for `check`'s line; a warning for them would
    /// never go away).
    pub txid_unbound: Option<Unbound>,
    /// `lifecycle.recreate_slot`.
    recreate_slot: bool,
    /// Every problem, in the order `run` meets them: server, slot, table,
    /// publication.
    pub problems: Vec<Problem>,
}

/// What `run` may do, by [`Readiness::admit`].
#[derive(Debug)]
pub(crate) enum Admission {
    /// Stream from `start`.
    Start {
        /// The outbox table.
        table: Table,
        /// The slot's confirmed position.
        start: u64,
    },
    /// Nothing stops the relay but a missing or invalidated slot.
    SlotLost {
        /// The outbox table.
        table: Table,
        /// The slot's problem.
        problem: Problem,
    },
    /// Stop (or stand by, for [`Effect::StandsBy`]) with this problem.
    Refused(Problem),
}

impl Readiness {
    /// Whether a poller can publish what a lost slot held: the table has the
    /// relay-managed columns and created_at. Without them, recreating the
    /// slot would silently skip what was written meanwhile.
    pub(crate) fn sweepable(&self) -> bool {
        self.table
            .as_ref()
            .is_some_and(|t| t.managed && t.created_at.is_some())
    }

    /// Whether `run` recreates a missing or invalidated slot.
    pub(crate) fn recreates(&self) -> bool {
        self.recreate_slot && self.sweepable()
    }

    /// The pgoutput protocol to stream the slot with: two-phase decoding
    /// for a slot created with `two_phase` on PostgreSQL 15 and later.
    /// PostgreSQL 14's pgoutput cannot decode prepared transactions; on such
    /// a slot it sends them at COMMIT PREPARED as ordinary transactions
    /// (Begin … Commit), which protocol version 1 reads as it is.
    pub(crate) fn protocol(&self) -> Protocol {
        match &self.slot {
            Some(slot) if slot.two_phase && self.server_version_num >= TWO_PHASE_PGOUTPUT => {
                Protocol::TwoPhase
            }
            _ => Protocol::V1,
        }
    }

    /// Why `lifecycle.on_published = "derive"` runs as `mark`, in `check`'s
    /// words ([`Problem::DerivedRunsAsMark`]); `None` when the lifecycle is
    /// as configured. `run` chooses its workers' mode by it at start.
    pub(crate) fn runs_as_mark(&self) -> Option<String> {
        self.problems
            .iter()
            .find(|p| matches!(p, Problem::DerivedRunsAsMark { .. }))
            .map(|p| p.describe(&self.names))
    }

    /// How `check` reports `problem`.
    pub(crate) fn severity(&self, problem: &Problem) -> Severity {
        problem.effect().severity(self.recreates())
    }

    /// What `run` does: the first problem that stops it, else the first that
    /// makes it stand by, else a lost slot; otherwise start. A lost slot
    /// comes last so that it is never recreated for a relay that cannot run.
    pub(crate) fn admit(self) -> Admission {
        let mut problems = self.problems;
        let first = |problems: &mut Vec<Problem>, effect: Effect| {
            let at = problems.iter().position(|p| p.effect() == effect)?;
            Some(problems.swap_remove(at))
        };
        if let Some(problem) = first(&mut problems, Effect::Stops) {
            return Admission::Refused(problem);
        }
        if let Some(problem) = first(&mut problems, Effect::StandsBy) {
            return Admission::Refused(problem);
        }
        // Each case below also stops the relay with a problem of its own
        // (inspect reports it); the fallbacks only keep this total.
        let Some(table) = self.table else {
            return Admission::Refused(Problem::TableMissing);
        };
        if let Some(problem) = first(&mut problems, Effect::StopsUnlessRecreated) {
            return Admission::SlotLost { table, problem };
        }
        match self.slot.and_then(|s| s.confirmed_flush) {
            Some(start) => Admission::Start { table, start },
            None => Admission::Refused(Problem::NoConfirmedPosition),
        }
    }
}

/// Inspect the server, `postgres.slot`, `postgres.table` and
/// `postgres.publication` as `config` names them.
pub(crate) async fn inspect(
    client: &tokio_postgres::Client,
    config: &Config,
) -> Result<Readiness, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), current_database()::text, \
               current_setting('server_version_num')::int, pg_is_in_recovery()",
            &[],
        )
        .await?;
    let names = Names {
        slot: config.postgres.slot.clone(),
        publication: config.postgres.publication.clone(),
        table: config.table(),
        database: row.get(1),
    };
    let wal_level: String = row.get(0);
    let server_version_num: i32 = row.get(2);
    let mut problems = Vec::new();
    if row.get::<_, bool>(3) {
        problems.push(Problem::Standby);
    }
    if wal_level != "logical" {
        problems.push(Problem::WalLevel {
            level: wal_level.clone(),
            platform: crate::postgres::platform::detect_or_self_managed(client).await,
        });
    }
    let slot = inspect_slot(client, &names, &mut problems).await?;
    if slot.is_some() {
        let failover = crate::postgres::failover::State::read(client, &names.slot).await?;
        problems.extend(
            failover
                .problem(config.postgres.failover_slot)
                .map(Problem::Failover),
        );
    }
    let table = Table::inspect(client, config).await?;
    let mut publication = Vec::new();
    let published = inspect_publication(client, &names, table.as_ref(), &mut publication).await?;
    // The table's problems before the publication's: a table that does not
    // fit is the first thing to fix.
    let (lifecycle, txid_unbound) = match &table {
        None => {
            problems.push(Problem::TableMissing);
            (None, None)
        }
        Some(table) => {
            let position =
                inspect_table(client, config, table, published.as_deref(), &mut problems).await?;
            let (lifecycle, unbound) = inspect_lifecycle(
                client,
                config,
                table,
                position,
                server_version_num,
                &mut problems,
            )
            .await?;
            (Some(lifecycle), unbound)
        }
    };
    problems.extend(publication);
    Ok(Readiness {
        names,
        wal_level,
        server_version_num,
        slot,
        table,
        lifecycle,
        txid_unbound,
        recreate_slot: config.lifecycle.recreate_slot,
        problems,
    })
}

async fn inspect_slot(
    client: &tokio_postgres::Client,
    names: &Names,
    problems: &mut Vec<Problem>,
) -> Result<Option<SlotView>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT s.plugin::text, s.database::text, s.confirmed_flush_lsn::text, s.active_pid, s.wal_status, \
               coalesce((to_jsonb(s) ->> 'two_phase')::bool, false), \
               coalesce(to_jsonb(s) ->> 'invalidation_reason', \
                 CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool AND pg_is_in_recovery() THEN $2 END) \
             FROM pg_replication_slots s WHERE s.slot_name = $1",
            &[&names.slot, &CONFLICTING],
        )
        .await?;
    let Some(row) = row else {
        problems.push(Problem::SlotMissing);
        return Ok(None);
    };
    let plugin: Option<String> = row.get(0);
    let database: Option<String> = row.get(1);
    let view = SlotView {
        confirmed_flush: row.get::<_, Option<&str>>(2).and_then(parse_lsn),
        wal_status: row.get(4),
        two_phase: row.get(5),
    };
    if plugin.as_deref() != Some("pgoutput") {
        let physical = plugin.is_none();
        problems.push(Problem::WrongPlugin { plugin });
        if physical {
            return Ok(Some(view));
        }
    }
    if database.as_deref() != Some(names.database.as_str()) {
        problems.push(Problem::OtherDatabase {
            database: database.unwrap_or_default(),
        });
    }
    let invalidated = view.wal_status.as_deref() == Some("lost");
    if invalidated {
        problems.push(Problem::Invalidated { reason: row.get(6) });
    }
    let busy = row.get::<_, Option<i32>>(3);
    if let Some(pid) = busy {
        problems.push(Problem::Busy { pid });
    }
    // A slot being created (pg_create_logical_replication_slot waits for
    // running transactions) is active and has no confirmed position yet:
    // busy, not broken. Whoever creates it will soon stream from it.
    if view.confirmed_flush.is_none() && !invalidated && busy.is_none() {
        problems.push(Problem::NoConfirmedPosition);
    }
    Ok(Some(view))
}

/// The publication's problems; the table's columns it sends, when it carries
/// the table with a column list (PostgreSQL 15+ lists them always).
async fn inspect_publication(
    client: &tokio_postgres::Client,
    names: &Names,
    table: Option<&Table>,
    problems: &mut Vec<Problem>,
) -> Result<Option<Vec<String>>, tokio_postgres::Error> {
    let Names {
        publication,
        table: name,
        ..
    } = names;
    let row = client
        .query_opt(
            "SELECT p.pubinsert, p.pubviaroot, t.tablename IS NOT NULL, to_jsonb(t) ->> 'rowfilter', \
               CASE WHEN jsonb_typeof(to_jsonb(t) -> 'attnames') = 'array' \
                 THEN ARRAY(SELECT jsonb_array_elements_text(to_jsonb(t) -> 'attnames')) END \
             FROM pg_publication p LEFT JOIN pg_publication_tables t \
               ON t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3 \
             WHERE p.pubname = $1",
            &[publication, &name.schema, &name.name],
        )
        .await?;
    let Some(row) = row else {
        problems.push(Problem::PublicationMissing);
        return Ok(None);
    };
    let (inserts, via_root, carried): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
    match table {
        // Its partitions are listed, not the table: the root's own
        // settings cannot be read until it is published via the root.
        Some(t) if t.partitioned && !via_root => problems.push(Problem::NotViaRoot),
        // A missing table is the table's problem, not the publication's.
        Some(_) if !carried => problems.push(Problem::TableNotPublished),
        Some(_) => {
            if let Some(filter) = row.get::<_, Option<String>>(3) {
                problems.push(Problem::RowFilter { filter });
            }
        }
        None => {}
    }
    if !inserts {
        problems.push(Problem::NoInserts);
    }
    Ok(if carried { row.get(4) } else { None })
}

/// The table against `[columns]`, as the publication sends it, and against
/// the lifecycle and recording the configuration needs; whether the
/// position table is there for the relay to write.
async fn inspect_table(
    client: &tokio_postgres::Client,
    config: &Config,
    table: &Table,
    published: Option<&[String]>,
    problems: &mut Vec<Problem>,
) -> Result<bool, tokio_postgres::Error> {
    let name = config.table().to_string();
    let all: Vec<(&str, u32)> = table
        .columns
        .iter()
        .map(|(n, t)| (n.as_str(), *t))
        .collect();
    match RowMapping::from_columns(&name, &all, &config.columns) {
        Err(e) => problems.push(Problem::Mapping(e)),
        Ok(mapping) => {
            for (key, column) in mapping.absent_optional {
                problems.push(Problem::OptionalColumnMissing { key, column });
            }
            // What the stream's Relation message will hold.
            let sent: Vec<(&str, u32)> = all
                .iter()
                .copied()
                .filter(|(n, _)| published.is_none_or(|p| p.iter().any(|c| c == n)))
                .collect();
            let left_out = |mapped: &mut dyn Iterator<Item = &str>| -> Vec<String> {
                mapped
                    .filter(|c| !c.is_empty())
                    .filter(|c| all.iter().any(|(n, _)| n == c))
                    .filter(|c| !sent.iter().any(|(n, _)| n == c))
                    .map(str::to_owned)
                    .collect()
            };
            let required = left_out(&mut config.columns.required().into_iter().map(|(_, c)| c));
            let optional = left_out(&mut config.columns.optional().into_iter().map(|(_, c)| c));
            if !required.is_empty() || !optional.is_empty() {
                problems.push(Problem::ColumnList {
                    required: !required.is_empty(),
                    columns: required.into_iter().chain(optional).collect(),
                });
            }
        }
    }
    let mode = config.lifecycle.on_published;
    if mode.tracks_rows() && !table.managed {
        problems.push(Problem::ManagedColumnsMissing { mode });
    }
    let table_name = config.table();
    let dead_letter = dead_letter_table(&table_name.name);
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&qualified(&table_name.schema, &dead_letter)],
        )
        .await?
        .get(0);
    if !exists {
        let dead_letter = quote_literal(&dead_letter);
        problems.push(if table.managed {
            Problem::NoDeadLetterTable { dead_letter }
        } else {
            Problem::NowhereToRecord { dead_letter }
        });
    }
    let position = qualified(
        &table_name.schema,
        &crate::postgres::position::table_name(&table_name.name),
    );
    let writable = crate::postgres::position::writable(client, &position).await?;
    if !writable {
        problems.push(Problem::NoPositionTable {
            position: quote_literal(&crate::postgres::position::table_name(&table_name.name)),
        });
    }
    Ok(writable)
}

/// The lifecycle in force: for `derive`, whether the table and the position
/// table have what it needs (the column, as `Table::derived` reads it, and a
/// position table the relay may write, `position` as [`inspect_table`]
/// found it, with the derived columns), else it
/// runs as `mark`; then what would weaken it (the column's default, its
/// indexes, who may set it, who else publishes it), and who may always set
/// it ([`Unbound`]).
async fn inspect_lifecycle(
    client: &tokio_postgres::Client,
    config: &Config,
    table: &Table,
    position: bool,
    server_version_num: i32,
    problems: &mut Vec<Problem>,
) -> Result<(Lifecycle, Option<Unbound>), tokio_postgres::Error> {
    let mode = config.lifecycle.on_published;
    // Without the managed columns the relay does not start (ManagedColumnsMissing).
    if mode != OnPublished::Derive || !table.managed {
        return Ok((Lifecycle::AsConfigured(mode), None));
    }
    let name = config.table();
    let column = derived::COLUMN;
    let mut missing = Vec::new();
    if !table.derived {
        let other: Option<String> = client
            .query_opt(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute                  WHERE attrelid = $1 AND attname = $2 AND NOT attisdropped",
                &[&table.oid, &column],
            )
            .await?
            .map(|r| r.get(0));
        missing.push(match other {
            Some(other) => format!("column {column} of table {name} is {other}, not xid8"),
            None => format!("table {name} has no column {column}"),
        });
    }
    let position_name = crate::postgres::position::table_name(&name.name);
    if !position {
        missing.push(format!(
            "there is no {} table the relay may write",
            quote_literal(&position_name)
        ));
    } else {
        let position = qualified(&name.schema, &position_name);
        let lacking = crate::postgres::position::missing_derived_columns(client, &position).await?;
        if !lacking.is_empty() {
            missing.push(format!(
                "table {} has no column {}",
                quote_literal(&position_name),
                lacking.join(", ")
            ));
        }
    }
    if !missing.is_empty() {
        problems.push(Problem::DerivedRunsAsMark { missing });
        return Ok((Lifecycle::DeriveAsMark, None));
    }
    let default: Option<String> = client
        .query_one(
            "SELECT pg_get_expr(d.adbin, d.adrelid) FROM pg_attribute a              LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum              WHERE a.attrelid = $1 AND a.attname = $2",
            &[&table.oid, &column],
        )
        .await?
        .get(0);
    if default.as_deref() != Some("pg_current_xact_id()") {
        problems.push(Problem::TxidDefault { default });
    }
    let wanted = [
        format!("{}_txid_idx", name.name),
        format!("{}_explicit_idx", name.name),
    ];
    let indexes: Vec<String> = client
        .query_one(
            "SELECT coalesce(array_agg(i ORDER BY n), '{}') FROM unnest($2::text[]) WITH ORDINALITY AS w(i, n)              WHERE NOT coalesce((SELECT indisvalid FROM pg_index                                   WHERE indexrelid = to_regclass(format('%I.%I', $1::text, i))), false)",
            &[&name.schema, &wanted.as_slice()],
        )
        .await?
        .get(0);
    if !indexes.is_empty() {
        problems.push(Problem::DerivedIndexMissing { indexes });
    }
    // Who may write the column, besides the owner (bound by no privilege:
    // docs/producers.md) and relays: the role checking, and roles that may
    // stream (REPLICATION, or rds_replication: what 004_role*.sql makes),
    // which hold UPDATE to mark rows. On the table and on each partition: an
    // insert straight into a partition is checked against the partition's
    // privileges alone, and streamed as the table's. TRIGGER too: a BEFORE
    // trigger may set the column whatever the column privileges say.
    let tree = derived::tree("$1::oid::regclass");
    let granted = client
        .query(
            &format!(
                "SELECT n.role, coalesce(array_agg(DISTINCT c.oid::regclass::text) FILTER (WHERE c.oid <> $1), '{{}}') \
                   FROM {tree} t JOIN pg_class c ON c.oid = t.relid \
                   CROSS JOIN LATERAL (SELECT (aclexplode(c.relacl)).* \
                                       UNION ALL \
                                       SELECT (aclexplode(a.attacl)).* FROM pg_attribute a \
                                        WHERE a.attrelid = c.oid AND a.attname = $2) g \
                   CROSS JOIN LATERAL (SELECT CASE WHEN g.grantee = 0 THEN 'PUBLIC' \
                                                   ELSE g.grantee::regrole::text END AS role) n \
                  WHERE g.privilege_type IN ('INSERT', 'UPDATE', 'TRIGGER') \
                    AND g.grantee <> c.relowner \
                    AND g.grantee <> (SELECT relowner FROM pg_class WHERE oid = $1) \
                    AND g.grantee IS DISTINCT FROM (SELECT oid FROM pg_roles WHERE rolname = current_user) \
                    AND NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = g.grantee AND (r.rolreplication \
                                    OR (to_regrole('rds_replication') IS NOT NULL \
                                        AND pg_has_role(r.oid, 'rds_replication', 'MEMBER')))) \
                  GROUP BY n.role ORDER BY n.role"
            ),
            &[&table.oid, &column],
        )
        .await?;
    let roles: Vec<(String, Vec<String>)> = granted.iter().map(|r| (r.get(0), r.get(1))).collect();
    // Who may write it whatever is granted, besides the table's owner, the
    // bootstrap superuser (every cluster has them: check's ok line names
    // them) and the role checking: roles that may log in and are
    // superusers, or may act as a superuser role, pg_write_all_data (14+),
    // the table's owner or the owner of one of its partitions. A role that
    // cannot log in acts only through its members, which are named.
    // Acting as a role: before 16 membership (a NOINHERIT member may still
    // SET ROLE); from 16 a grant's INHERIT (USAGE) or SET option, since a
    // membership with neither gives nothing.
    let acts_as = |role: &str| {
        if server_version_num >= 160_000 {
            format!("(pg_has_role(r.oid, {role}, 'USAGE') OR pg_has_role(r.oid, {role}, 'SET'))")
        } else {
            format!("pg_has_role(r.oid, {role}, 'MEMBER')")
        }
    };
    let write_all = format!(
        "(to_regrole('pg_write_all_data') IS NOT NULL AND {})",
        acts_as("'pg_write_all_data'")
    );
    let superuser = format!(
        "EXISTS (SELECT 1 FROM pg_roles s WHERE s.rolsuper AND s.oid <> r.oid AND {})",
        acts_as("s.oid")
    );
    let owner = acts_as("c.relowner");
    let rows = client
        .query(
            &format!(
                "SELECT DISTINCT ON (1) r.oid::regrole::text, CASE WHEN r.rolsuper THEN 'superuser' \
                          WHEN {superuser} THEN 'may act as a superuser role' \
                          WHEN {write_all} THEN 'member of pg_write_all_data' \
                          WHEN r.oid = c.relowner THEN 'owner of partition ' || c.oid::regclass::text \
                          ELSE 'member of the owner ' || c.relowner::regrole::text \
                               || CASE WHEN c.oid <> $1 THEN ' of partition ' || c.oid::regclass::text ELSE '' END END \
                 FROM {tree} t JOIN pg_class c ON c.oid = t.relid JOIN pg_roles r ON r.rolcanlogin \
                 WHERE r.oid <> (SELECT relowner FROM pg_class WHERE oid = $1) AND r.oid <> 10 \
                   AND r.rolname <> current_user AND r.rolname !~ '^pg_' \
                   AND (r.rolsuper OR {superuser} OR {write_all} OR {owner}) \
                 ORDER BY 1, c.oid = $1 DESC, c.oid"
            ),
            &[&table.oid],
        )
        .await?;
    let bypass: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    // A grant does not matter to a role that needs none: it is named once, as bypassing.
    let roles: Vec<String> = roles
        .into_iter()
        .filter(|(role, _)| !bypass.iter().any(|(name, _)| name == role))
        .map(|(role, through)| {
            if through.is_empty() {
                role
            } else {
                format!("{role} (through {})", through.join(", "))
            }
        })
        .collect();
    let bypassing: Vec<String> = bypass
        .into_iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    if !roles.is_empty() || !bypassing.is_empty() {
        problems.push(Problem::TxidForgeable { roles, bypassing });
    }
    let relations: Vec<String> = client
        .query_one(
            &format!(
                "SELECT coalesce(array_agg(c.oid::regclass::text \
                           || CASE WHEN c.relkind = 'f' THEN ' (foreign)' ELSE ' (unlogged)' END ORDER BY 1), '{{}}') \
                   FROM {tree} t JOIN pg_class c ON c.oid = t.relid \
                  WHERE {no_wal}",
                no_wal = derived::WRITES_NO_WAL
            ),
            &[&table.oid],
        )
        .await?
        .get(0);
    if !relations.is_empty() {
        problems.push(Problem::NotLogged { relations });
    }
    // The requeue trigger, on the table and (cloned) on each partition.
    let trigger = crate::postgres::setup::requeue_trigger(&name.name);
    let relations: Vec<String> = client
        .query_one(
            &format!(
                "SELECT coalesce(array_agg(c.oid::regclass::text || ': ' || CASE \
                           WHEN g.tgenabled IS NULL THEN 'missing' \
                           WHEN g.tgenabled = 'D' THEN 'disabled' \
                           WHEN g.tgenabled = 'O' THEN 'not under session_replication_role = replica' \
                           ELSE 'only under session_replication_role = replica' END ORDER BY c.oid), '{{}}') \
                   FROM {tree} t JOIN pg_class c ON c.oid = t.relid \
                   LEFT JOIN pg_trigger g ON g.tgrelid = c.oid AND g.tgname = $2 \
                  WHERE c.relkind IN ('r', 'p') AND g.tgenabled IS DISTINCT FROM 'A'"
            ),
            &[&table.oid, &trigger],
        )
        .await?
        .get(0);
    if !relations.is_empty() {
        problems.push(Problem::RequeueTrigger { trigger, relations });
    }
    // Who may write the position table besides its owner, the role checking
    // and relays (roles that may stream), which write their own rows.
    let position = qualified(&name.schema, &position_name);
    let writers: Vec<String> = client
        .query_one(
            "SELECT coalesce(array_agg(w ORDER BY w), '{}') FROM ( \
               SELECT DISTINCT CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE g.grantee::regrole::text END AS w \
                 FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) g \
                WHERE c.oid = to_regclass($1) \
                  AND g.privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE') \
                  AND g.grantee <> c.relowner \
                  AND g.grantee IS DISTINCT FROM (SELECT oid FROM pg_roles WHERE rolname = current_user) \
                  AND NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = g.grantee AND (r.rolreplication \
                                  OR (to_regrole('rds_replication') IS NOT NULL \
                                      AND pg_has_role(r.oid, 'rds_replication', 'MEMBER'))))) s",
            &[&position],
        )
        .await?
        .get(0);
    if !writers.is_empty() {
        problems.push(Problem::PositionWritable {
            position,
            roles: writers,
        });
    }
    let row = client
        .query_one(
            "SELECT c.relowner::regrole::text, 10::oid::regrole::text FROM pg_class c WHERE c.oid = $1",
            &[&table.oid],
        )
        .await?;
    let unbound = Unbound {
        owner: row.get(0),
        bootstrap: row.get(1),
    };
    // Column lists came with PostgreSQL 15; before, every publication of
    // the table sends every column and there is nothing to fix.
    if server_version_num >= 150_000 {
        let publications: Vec<String> = client
            .query_one(
                "SELECT coalesce(array_agg(DISTINCT t.pubname::text), '{}') FROM pg_publication_tables t                  WHERE t.schemaname = $1 AND t.tablename = $2 AND t.pubname <> $3                    AND $4 = ANY(ARRAY(SELECT jsonb_array_elements_text(to_jsonb(t) -> 'attnames')))",
                &[&name.schema, &name.name, &config.postgres.publication, &column],
            )
            .await?
            .get(0);
        if !publications.is_empty() {
            problems.push(Problem::TxidPublished { publications });
        }
    }
    Ok((Lifecycle::AsConfigured(OnPublished::Derive), Some(unbound)))
}

/// `check`'s ok line for the slot.
pub(crate) fn slot_summary(ready: &Readiness, view: &SlotView) -> String {
    let two_phase = match (view.two_phase, ready.protocol()) {
        (false, _) => "",
        (true, Protocol::TwoPhase) => {
            ", two_phase: prepared transactions are published at COMMIT PREPARED and hold the \
             confirmed position until then"
        }
        (true, Protocol::V1) => {
            ", two_phase: this server's pgoutput sends prepared transactions at COMMIT PREPARED, \
             as ordinary ones"
        }
    };
    format!(
        "replication slot {:?} (pgoutput{two_phase}, confirmed at {}, wal_status {})",
        ready.names.slot,
        view.confirmed_flush.map(format_lsn).unwrap_or_default(),
        view.wal_status.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Names {
        Names {
            slot: "s".into(),
            publication: "p".into(),
            table: TableName {
                schema: "public".into(),
                name: "outbox".into(),
            },
            database: "app".into(),
        }
    }

    fn mapping_error() -> MappingError {
        match RowMapping::from_columns("public.outbox", &[("id", 25)], &Default::default()) {
            Err(e) => e,
            Ok(_) => panic!("a table of one column does not fit"),
        }
    }

    /// Every problem, with what `run` does and how `check` reports it
    /// without and with a recreatable slot.
    fn every_problem() -> Vec<(Problem, Effect, Severity, Severity)> {
        use Effect::*;
        use Severity::*;
        vec![
            (
                Problem::WalLevel {
                    level: "replica".into(),
                    platform: Platform::SelfManaged,
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::WalLevel {
                    level: "replica".into(),
                    platform: Platform::Rds,
                },
                Stops,
                Error,
                Error,
            ),
            (Problem::SlotMissing, StopsUnlessRecreated, Error, Warning),
            (
                Problem::WrongPlugin {
                    plugin: Some("test_decoding".into()),
                },
                Stops,
                Error,
                Error,
            ),
            (Problem::WrongPlugin { plugin: None }, Stops, Error, Error),
            (
                Problem::OtherDatabase {
                    database: "other".into(),
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::Invalidated { reason: None },
                StopsUnlessRecreated,
                Error,
                Warning,
            ),
            (
                Problem::Invalidated {
                    reason: Some("idle_timeout".into()),
                },
                StopsUnlessRecreated,
                Error,
                Warning,
            ),
            (Problem::Standby, Stops, Error, Error),
            (Problem::Busy { pid: 7 }, StandsBy, Warning, Warning),
            (
                Problem::Failover(crate::postgres::failover::Problem::NotFailover),
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::Failover(crate::postgres::failover::Problem::NoStandbyWaited),
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::NoPositionTable {
                    position: "'outbox_position'".into(),
                },
                Warns,
                Warning,
                Warning,
            ),
            (Problem::NoConfirmedPosition, Stops, Error, Error),
            (Problem::TableMissing, Stops, Error, Error),
            (Problem::Mapping(mapping_error()), Stops, Error, Error),
            (
                Problem::OptionalColumnMissing {
                    key: "topic",
                    column: "topic".into(),
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::ManagedColumnsMissing {
                    mode: OnPublished::Mark,
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::ManagedColumnsMissing {
                    mode: OnPublished::Derive,
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::DerivedRunsAsMark {
                    missing: vec!["table public.outbox has no column relay_txid".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidDefault { default: None },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidDefault {
                    default: Some("'5'::xid8".into()),
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::DerivedIndexMissing {
                    indexes: vec!["outbox_txid_idx".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidForgeable {
                    roles: vec!["app".into()],
                    bypassing: Vec::new(),
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidForgeable {
                    roles: Vec::new(),
                    bypassing: vec!["etl (member of pg_write_all_data)".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidForgeable {
                    roles: vec!["app".into()],
                    bypassing: vec![
                        "admin (superuser)".into(),
                        "etl (member of pg_write_all_data)".into(),
                    ],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::TxidPublished {
                    publications: vec!["other".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::NotLogged {
                    relations: vec!["outbox_2019 (unlogged)".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::PositionWritable {
                    position: "public.outbox_position".into(),
                    roles: vec!["app".into()],
                },
                Warns,
                Warning,
                Warning,
            ),
            (
                Problem::NowhereToRecord {
                    dead_letter: "'outbox_dead_letter'".into(),
                },
                Stops,
                Error,
                Error,
            ),
            (Problem::PublicationMissing, Stops, Error, Error),
            (Problem::NotViaRoot, Stops, Error, Error),
            (Problem::TableNotPublished, Stops, Error, Error),
            (Problem::NoInserts, Stops, Error, Error),
            (
                Problem::RowFilter {
                    filter: "(aggregate_id <> 'x'::text)".into(),
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::ColumnList {
                    columns: vec!["event_type".into()],
                    required: true,
                },
                Stops,
                Error,
                Error,
            ),
            (
                Problem::ColumnList {
                    columns: vec!["topic".into()],
                    required: false,
                },
                Warns,
                Warning,
                Warning,
            ),
        ]
    }

    #[test]
    fn each_problem_has_one_effect_and_check_reports_what_run_refuses_as_an_error() {
        for (problem, effect, plain, recreating) in every_problem() {
            assert_eq!(problem.effect(), effect, "{problem:?}");
            assert_eq!(effect.severity(false), plain, "{problem:?}");
            assert_eq!(effect.severity(true), recreating, "{problem:?}");
            // `run` stops exactly on what `check` calls an error: a problem
            // that neither waiting nor recreating the slot mends.
            let refused = effect != Effect::Warns && !effect.transient();
            assert_eq!(refused, plain == Severity::Error, "{problem:?}");
            let refused_recreating = refused && !effect.lost();
            assert_eq!(
                refused_recreating,
                recreating == Severity::Error,
                "{problem:?}"
            );
        }
    }

    #[test]
    fn run_stands_by_only_for_a_busy_slot_and_recreates_only_a_lost_one() {
        for (problem, effect, ..) in every_problem() {
            let busy = matches!(problem, Problem::Busy { .. });
            let lost = matches!(problem, Problem::SlotMissing | Problem::Invalidated { .. });
            assert_eq!(effect.transient(), busy, "{problem:?}");
            assert_eq!(effect.lost(), lost, "{problem:?}");
        }
    }

    #[test]
    fn every_problem_names_its_fix_and_run_and_check_say_it_alike() {
        let at = names();
        for (problem, ..) in every_problem() {
            let text = problem.describe(&at);
            match problem.fix(&at) {
                Some(fix) => assert!(text.ends_with(&fix), "{text}"),
                // These carry their fix in their own words.
                None => assert!(
                    text.contains("columns.") || text.contains("setup --config FILE --apply"),
                    "{text}"
                ),
            }
            assert!(!text.contains("{}") && !text.is_empty(), "{text}");
        }
    }

    #[test]
    fn a_forgeable_txid_names_who_is_granted_it_and_who_bypasses_privileges_each_with_its_fix() {
        let text = |roles: &[&str], bypassing: &[&str]| {
            Problem::TxidForgeable {
                roles: roles.iter().map(|r| r.to_string()).collect(),
                bypassing: bypassing.iter().map(|r| r.to_string()).collect(),
            }
            .describe(&names())
        };
        let granted = text(&["app"], &[]);
        assert!(
            granted
                .starts_with("role app may set relay_txid in table public.outbox (a table-level")
                && granted.contains("--producer-role")
                && !granted.contains("bypass"),
            "{granted}"
        );
        let bypassing = text(&[], &["etl (member of pg_write_all_data)"]);
        assert!(
            bypassing.starts_with(
                "role etl (member of pg_write_all_data) bypasses column privileges and may set \
                 relay_txid in table public.outbox whatever is granted: they must be trusted \
                 application code or not write the outbox: a row with a forged id"
            ) && bypassing.contains("REVOKE pg_write_all_data FROM name")
                && !bypassing.contains("--producer-role"),
            "{bypassing}"
        );
        let both = text(
            &["app"],
            &["admin (superuser)", "etl (member of pg_write_all_data)"],
        );
        assert!(
            both.contains("role app may set relay_txid")
                && both.contains(
                    "; roles admin (superuser), etl (member of pg_write_all_data) bypass column \
                     privileges"
                )
                && both.contains("--producer-role")
                && both.contains("ALTER ROLE name NOSUPERUSER"),
            "{both}"
        );
    }

    #[test]
    fn wal_level_below_logical_is_fixed_with_the_platforms_own_setting() {
        let text = |platform| {
            Problem::WalLevel {
                level: "replica".into(),
                platform,
            }
            .describe(&names())
        };
        assert_eq!(
            text(Platform::SelfManaged),
            "wal_level = replica; logical replication needs wal_level = logical: \
             ALTER SYSTEM SET wal_level = logical, then restart Postgres"
        );
        for (platform, setting) in [
            (
                Platform::Rds,
                "rds.logical_replication = 1 in the instance's DB parameter group",
            ),
            (
                Platform::Aurora,
                "rds.logical_replication = 1 in the DB cluster parameter group",
            ),
            (Platform::CloudSql, "cloudsql.logical_decoding"),
            (Platform::Azure, "server parameter wal_level to logical"),
            (Platform::Neon, "Logical Replication, Enable"),
        ] {
            let text = text(platform);
            assert!(
                text.contains(setting)
                    && text.contains(platform.name())
                    && !text.contains("ALTER SYSTEM"),
                "{text}"
            );
        }
    }

    #[test]
    fn an_invalidated_slot_names_the_servers_reason() {
        for (reason, says) in [
            (None, "max_slot_wal_keep_size"),
            (Some("wal_removed"), "max_slot_wal_keep_size"),
            (Some("rows_removed"), "rows_removed"),
            (Some("wal_level_insufficient"), "wal_level"),
            (Some("idle_timeout"), "idle_replication_slot_timeout"),
            (Some(CONFLICTING), "conflicted with recovery"),
            (Some("something_new"), "invalidation_reason = something_new"),
        ] {
            let problem = Problem::Invalidated {
                reason: reason.map(str::to_owned),
            };
            let text = problem.message(&names());
            assert!(
                text.contains("wal_status = lost") && text.contains(says),
                "{text}"
            );
        }
    }

    fn table() -> Table {
        Table {
            qualified: "\"public\".\"outbox\"".into(),
            id: "\"id\"".into(),
            id_type: "uuid".into(),
            created_at: Some("\"created_at\"".into()),
            columns: Vec::new(),
            managed: true,
            derived: false,
            partitioned: false,
            oid: 1,
        }
    }

    fn readiness(problems: Vec<Problem>, recreate_slot: bool) -> Readiness {
        Readiness {
            names: names(),
            wal_level: "logical".into(),
            server_version_num: 150_004,
            slot: Some(SlotView {
                confirmed_flush: Some(42),
                wal_status: Some("reserved".into()),
                two_phase: false,
            }),
            table: Some(table()),
            lifecycle: Some(Lifecycle::AsConfigured(OnPublished::Derive)),
            txid_unbound: None,
            recreate_slot,
            problems,
        }
    }

    #[test]
    fn run_meets_what_stops_it_before_a_busy_slot_and_a_lost_slot_last() {
        let admitted = |problems| readiness(problems, true).admit();
        assert!(matches!(
            admitted(vec![]),
            Admission::Start { start: 42, .. }
        ));
        assert!(matches!(
            admitted(vec![Problem::OptionalColumnMissing {
                key: "topic",
                column: "topic".into()
            }]),
            Admission::Start { .. }
        ));
        assert!(matches!(
            admitted(vec![Problem::SlotMissing, Problem::PublicationMissing]),
            Admission::Refused(Problem::PublicationMissing)
        ));
        assert!(matches!(
            admitted(vec![
                Problem::Busy { pid: 1 },
                Problem::RowFilter { filter: "x".into() }
            ]),
            Admission::Refused(Problem::RowFilter { .. })
        ));
        assert!(matches!(
            admitted(vec![Problem::NoInserts, Problem::Busy { pid: 1 }]),
            Admission::Refused(Problem::NoInserts)
        ));
        assert!(matches!(
            admitted(vec![Problem::Busy { pid: 1 }]),
            Admission::Refused(Problem::Busy { .. })
        ));
        assert!(matches!(
            admitted(vec![Problem::Invalidated { reason: None }]),
            Admission::SlotLost { .. }
        ));
    }

    #[test]
    fn a_two_phase_slot_is_streamed_with_two_phase_decoding_from_postgresql_15() {
        let two_phase = |version, slot: bool| {
            let mut ready = readiness(vec![], false);
            ready.server_version_num = version;
            ready.slot.as_mut().unwrap().two_phase = slot;
            let summary = slot_summary(&ready, ready.slot.as_ref().unwrap());
            (ready.protocol(), summary)
        };
        for version in [150_000, 160_002, 180_001] {
            let (protocol, summary) = two_phase(version, true);
            assert_eq!(protocol, Protocol::TwoPhase);
            assert!(summary.contains("hold the confirmed position"), "{summary}");
            assert_eq!(two_phase(version, false).0, Protocol::V1);
        }
        // 14's pgoutput has no two-phase decoding: version 1 reads what it sends.
        let (protocol, summary) = two_phase(140_019, true);
        assert_eq!(protocol, Protocol::V1);
        assert!(summary.contains("as ordinary ones"), "{summary}");
        assert!(!two_phase(140_019, false).1.contains("two_phase"));
    }

    #[test]
    fn check_warns_of_a_lost_slot_only_when_run_would_recreate_it() {
        let lost = || vec![Problem::SlotMissing];
        let ready = readiness(lost(), true);
        assert_eq!(ready.severity(&ready.problems[0]), Severity::Warning);
        let ready = readiness(lost(), false);
        assert_eq!(ready.severity(&ready.problems[0]), Severity::Error);
        // Nothing could sweep what the slot held: run does not recreate it.
        let mut ready = readiness(lost(), true);
        ready.table.as_mut().unwrap().created_at = None;
        assert_eq!(ready.severity(&ready.problems[0]), Severity::Error);
    }
}
