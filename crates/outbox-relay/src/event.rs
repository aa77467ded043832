//! From a replicated row to an [`OutboxEvent`], through the configured column mapping.
//!
//! A [`Relation`](pgoutput::Relation) message describes a table's columns by
//! position; [`RowMapping::new`] resolves the configured column names to
//! positions once per relation (Postgres re-sends the Relation after a
//! reconnect or a DDL change, and the mapping is rebuilt then). Mapping a row
//! is then a walk over the tuple without lookups by name.
//!
//! Two kinds of failure, kept apart:
//! * [`MappingError`]: the table does not fit the configuration (a required
//!   column is missing, the payload has a type we cannot carry). Every row
//!   would fail the same way, so this stops the relay with a message naming
//!   the key to fix; nothing is acknowledged, nothing is lost.
//! * [`RowError`]: this one row cannot become an event (a NULL in a required
//!   column, text that is not UTF-8). The row is rejected with the reason and
//!   the stream moves on.

use std::fmt;

use bytes::Bytes;
use pgoutput::{Relation, TupleData, Value};

/// A row's column values by position, in Postgres's text format: a pgoutput
/// tuple, or a row read with SQL (`column::text` under the same session
/// settings, so both print values identically).
pub trait Columns {
    /// The value at `index`, `None` past the end.
    fn value(&self, index: usize) -> Option<Value>;
    /// How many columns.
    fn count(&self) -> usize;
    /// The values at `indices`, as [`value`](Self::value) gives each; in one
    /// pass where the row is encoded.
    fn values<const N: usize>(&self, indices: [usize; N]) -> [Option<Value>; N] {
        indices.map(|i| self.value(i))
    }
}

impl Columns for TupleData {
    fn value(&self, index: usize) -> Option<Value> {
        self.get(index)
    }
    fn values<const N: usize>(&self, indices: [usize; N]) -> [Option<Value>; N] {
        self.get_many(indices)
    }
    fn count(&self) -> usize {
        self.len()
    }
}

/// A row read with SQL, each column as text (`None` for NULL).
#[derive(Debug, Clone, Default)]
pub struct TextRow(pub Vec<Option<Bytes>>);

impl Columns for TextRow {
    fn value(&self, index: usize) -> Option<Value> {
        self.0.get(index).map(|v| match v {
            Some(b) => Value::Text(b.clone()),
            None => Value::Null,
        })
    }
    fn count(&self) -> usize {
        self.0.len()
    }
}

use crate::config::ColumnMapping;

/// Type OIDs the payload column may have.
mod oid {
    pub const BYTEA: u32 = 17;
    pub const TEXT: u32 = 25;
    pub const JSON: u32 = 114;
    pub const BPCHAR: u32 = 1042;
    pub const VARCHAR: u32 = 1043;
    pub const JSONB: u32 = 3802;
}

/// Whether a payload column of type `type_oid` can be carried (jsonb, json,
/// text, varchar, char, bytea).
pub fn payload_type_supported(type_oid: u32) -> bool {
    matches!(
        type_oid,
        oid::JSONB | oid::JSON | oid::TEXT | oid::VARCHAR | oid::BPCHAR | oid::BYTEA
    )
}

/// UTF-8 text that shares the replication message's buffer.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Text(Bytes);

impl Text {
    /// Checks `bytes` are UTF-8.
    pub fn new(bytes: Bytes) -> Result<Self, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(Self(bytes))
    }

    /// The text.
    #[allow(unsafe_code)]
    pub fn as_str(&self) -> &str {
        // SAFETY: `new` and `From<String>`/`From<&str>` are the only constructors,
        // and each one holds valid UTF-8; `Bytes` is immutable.
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }

    /// The bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        Self(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl From<String> for Text {
    fn from(s: String) -> Self {
        Self(Bytes::from(s))
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The payload, as its column type delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// jsonb or json: valid JSON text (Postgres checked it on insert).
    Json(Text),
    /// text or varchar: JSON or not, to be seen.
    Text(Text),
    /// bytea: any bytes.
    Binary(Bytes),
}

/// One outbox row, ready to become an envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// Event id: the envelope id and the deduplication id.
    pub id: Text,
    /// Aggregate type.
    pub aggregate_type: Text,
    /// Aggregate id.
    pub aggregate_id: Text,
    /// Event type.
    pub event_type: Text,
    /// The payload.
    pub payload: Payload,
    /// Headers, a JSON object (text of a jsonb/json column), when present.
    pub headers: Option<Text>,
    /// Per-row topic override.
    pub topic: Option<Text>,
    /// Ordering group (FIFO MessageGroupId): `columns.group`, default the aggregate id.
    pub group: Text,
    /// When the event happened, RFC 3339; the commit time when the table has no such column.
    pub time: Text,
}

/// The outbox table does not fit the column mapping.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    /// A required column is not in the table.
    #[error(
        "table {table} has no column {column:?} for columns.{key}: set columns.{key} to the \
         column that holds it (the table has: {available})"
    )]
    MissingColumn {
        /// The table.
        table: String,
        /// The mapping key.
        key: &'static str,
        /// The configured column name.
        column: String,
        /// The table's columns.
        available: String,
    },
    /// The payload column's type cannot be carried.
    #[error(
        "column {table}.{column} (columns.payload) has type oid {type_oid}; the payload must be \
         jsonb, json, text, varchar or bytea"
    )]
    PayloadType {
        /// The table.
        table: String,
        /// The column.
        column: String,
        /// Its type.
        type_oid: u32,
    },
}

/// This row cannot become an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    /// The tuple has fewer columns than the relation.
    #[error("the row has {got} columns, the relation announced more (column {column:?} missing)")]
    ShortRow {
        /// Columns in the row.
        got: usize,
        /// The column looked for.
        column: String,
    },
    /// NULL where a value is required.
    #[error("column {0:?} is NULL; an outbox event needs it")]
    Null(String),
    /// Not valid UTF-8.
    #[error("column {0:?} is not valid UTF-8")]
    NotUtf8(String),
    /// A value the text protocol should not produce (binary, or unchanged TOAST on an insert).
    #[error("column {column:?} arrived as {kind}, which an insert should not carry")]
    Unexpected {
        /// The column.
        column: String,
        /// What arrived.
        kind: &'static str,
    },
    /// A bytea payload that is not in hex output format.
    #[error("column {0:?}: bytea value is not in hex format (set bytea_output = 'hex')")]
    Bytea(String),
}

#[derive(Debug, Clone)]
struct Slot {
    index: usize,
    name: String,
}

/// Column positions of the outbox table, resolved from a Relation message.
#[derive(Debug, Clone)]
pub struct RowMapping {
    id: Slot,
    aggregate_type: Slot,
    aggregate_id: Slot,
    event_type: Slot,
    payload: Slot,
    payload_kind: PayloadKind,
    headers: Option<Slot>,
    topic: Option<Slot>,
    created_at: Option<Slot>,
    /// `None`: the aggregate id.
    group: Option<Slot>,
    /// Optional columns configured but absent from the table, for a warning.
    pub absent_optional: Vec<(&'static str, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PayloadKind {
    Json,
    Text,
    Binary,
}

impl RowMapping {
    /// Resolve `columns` against `relation`.
    pub fn new(relation: &Relation, columns: &ColumnMapping) -> Result<Self, MappingError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        let described: Vec<(&str, u32)> = relation
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.type_oid))
            .collect();
        Self::from_columns(&table, &described, columns)
    }

    /// Resolve `columns` against a table's `(name, type oid)` columns, in order.
    pub fn from_columns(
        table: &str,
        described: &[(&str, u32)],
        columns: &ColumnMapping,
    ) -> Result<Self, MappingError> {
        let table = table.to_owned();
        let find = |name: &str| {
            described
                .iter()
                .position(|(n, _)| *n == name)
                .map(|index| Slot {
                    index,
                    name: name.to_owned(),
                })
        };
        let required = |key: &'static str, name: &str| {
            find(name).ok_or_else(|| MappingError::MissingColumn {
                table: table.clone(),
                key,
                column: name.to_owned(),
                available: described
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
        };
        let payload = required("payload", &columns.payload)?;
        let payload_kind = match described[payload.index].1 {
            oid::JSONB | oid::JSON => PayloadKind::Json,
            oid::TEXT | oid::VARCHAR | oid::BPCHAR => PayloadKind::Text,
            oid::BYTEA => PayloadKind::Binary,
            type_oid => {
                return Err(MappingError::PayloadType {
                    table,
                    column: columns.payload.clone(),
                    type_oid,
                })
            }
        };
        let mut absent_optional = Vec::new();
        let mut optional = |key: &'static str, name: &str| {
            if name.is_empty() {
                return None;
            }
            let found = find(name);
            if found.is_none() {
                absent_optional.push((key, name.to_owned()));
            }
            found
        };
        let headers = optional("headers", &columns.headers);
        let topic = optional("topic", &columns.topic);
        let created_at = optional("created_at", &columns.created_at);
        let group = if columns.group.is_empty() {
            None
        } else {
            Some(required("group", &columns.group)?)
        };
        Ok(Self {
            id: required("id", &columns.id)?,
            aggregate_type: required("aggregate_type", &columns.aggregate_type)?,
            aggregate_id: required("aggregate_id", &columns.aggregate_id)?,
            event_type: required("event_type", &columns.event_type)?,
            payload,
            payload_kind,
            headers,
            topic,
            created_at,
            group,
            absent_optional,
        })
    }

    /// The event id alone, for naming a row that failed to map.
    pub fn id_of(&self, tuple: &impl Columns) -> Option<String> {
        match tuple.value(self.id.index) {
            Some(Value::Text(b)) => Some(String::from_utf8_lossy(&b).into_owned()),
            _ => None,
        }
    }

    /// Build the event from an inserted row; `commit_time` (µs since
    /// 2000-01-01) stands in for a missing `created_at`.
    pub fn event(&self, tuple: &impl Columns, commit_time: i64) -> Result<OutboxEvent, RowError> {
        // Every field in one pass over the row; a field not configured asks
        // for a column past the end and gets `None`.
        let index = |slot: Option<&Slot>| slot.map_or(usize::MAX, |s| s.index);
        let [id, aggregate_type, aggregate_id, event_type, payload, created_at, group, headers, topic] =
            tuple.values([
                self.id.index,
                self.aggregate_type.index,
                self.aggregate_id.index,
                self.event_type.index,
                self.payload.index,
                index(self.created_at.as_ref()),
                index(self.group.as_ref()),
                index(self.headers.as_ref()),
                index(self.topic.as_ref()),
            ]);
        let count = tuple.count();
        let payload = match self.payload_kind {
            PayloadKind::Json => Payload::Json(text(payload, count, &self.payload)?),
            PayloadKind::Text => Payload::Text(text(payload, count, &self.payload)?),
            PayloadKind::Binary => Payload::Binary(decode_bytea(
                &raw(payload, count, &self.payload)?,
                &self.payload.name,
            )?),
        };
        let time = match optional_text(created_at, count, self.created_at.as_ref())? {
            Some(t) => Text::from(rfc3339_from_pg(t.as_str())),
            None => Text::from(rfc3339_from_pg_micros(commit_time)),
        };
        let aggregate_id = text(aggregate_id, count, &self.aggregate_id)?;
        let group = match &self.group {
            Some(slot) => text(group, count, slot)?,
            None => aggregate_id.clone(),
        };
        Ok(OutboxEvent {
            id: text(id, count, &self.id)?,
            aggregate_type: text(aggregate_type, count, &self.aggregate_type)?,
            aggregate_id,
            group,
            event_type: text(event_type, count, &self.event_type)?,
            payload,
            headers: optional_text(headers, count, self.headers.as_ref())?,
            topic: optional_text(topic, count, self.topic.as_ref())?
                .filter(|t| !t.as_str().is_empty()),
            time,
        })
    }
}

/// The column's value as text bytes; `value` is what the row holds at the
/// slot's position (`None`: the row has only `count` columns).
fn raw(value: Option<Value>, count: usize, slot: &Slot) -> Result<Bytes, RowError> {
    match value.ok_or_else(|| RowError::ShortRow {
        got: count,
        column: slot.name.clone(),
    })? {
        Value::Text(b) => Ok(b),
        Value::Null => Err(RowError::Null(slot.name.clone())),
        Value::UnchangedToast => Err(RowError::Unexpected {
            column: slot.name.clone(),
            kind: "an unchanged TOAST value",
        }),
        Value::Binary(_) => Err(RowError::Unexpected {
            column: slot.name.clone(),
            kind: "a binary value",
        }),
    }
}

fn text(value: Option<Value>, count: usize, slot: &Slot) -> Result<Text, RowError> {
    Text::new(raw(value, count, slot)?).map_err(|_| RowError::NotUtf8(slot.name.clone()))
}

fn optional_text(
    value: Option<Value>,
    count: usize,
    slot: Option<&Slot>,
) -> Result<Option<Text>, RowError> {
    let Some(slot) = slot else { return Ok(None) };
    if matches!(value, Some(Value::Null)) {
        return Ok(None);
    }
    text(value, count, slot).map(Some)
}

/// bytea in text output is `\x` followed by hex digits.
fn decode_bytea(raw: &[u8], column: &str) -> Result<Bytes, RowError> {
    let hex = raw
        .strip_prefix(b"\\x")
        .ok_or_else(|| RowError::Bytea(column.to_owned()))?;
    if hex.len() % 2 != 0 {
        return Err(RowError::Bytea(column.to_owned()));
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    hex.chunks_exact(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
        .ok_or_else(|| RowError::Bytea(column.to_owned()))
}

/// Postgres `timestamptz` text (ISO DateStyle, e.g. `2026-11-22 05:48:24.123456+00`)
/// to RFC 3339 (`2026-11-22T05:48:24.123456Z`). A `timestamp` without zone is taken as UTC.
pub fn rfc3339_from_pg(pg: &str) -> String {
    // The first space (between date and time) becomes a `T`; room for ":00".
    let mut out = String::with_capacity(pg.len() + 3);
    match pg.split_once(' ') {
        Some((date, time)) => {
            out.push_str(date);
            out.push('T');
            out.push_str(time);
        }
        None => out.push_str(pg),
    }
    // The zone starts at the last '+' or '-' after the time part.
    let time_start = out.find('T').map_or(0, |i| i + 1);
    match out[time_start..].rfind(['+', '-']).map(|i| i + time_start) {
        Some(zone) => {
            let offset = &out[zone + 1..];
            match offset {
                "00" | "00:00" => {
                    out.truncate(zone);
                    out.push('Z');
                }
                _ if offset.len() == 2 => out.push_str(":00"),
                _ => {}
            }
        }
        None => out.push('Z'),
    }
    out
}

/// Microseconds since 2000-01-01 UTC (Postgres epoch) to RFC 3339 in UTC.
pub fn rfc3339_from_pg_micros(micros: i64) -> String {
    const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;
    let secs = micros.div_euclid(1_000_000) + PG_EPOCH_UNIX_SECS;
    let frac = micros.rem_euclid(1_000_000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{frac:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_timestamps_become_rfc3339() {
        assert_eq!(
            rfc3339_from_pg("2026-11-22 05:48:24.123456+00"),
            "2026-11-22T05:48:24.123456Z"
        );
        assert_eq!(
            rfc3339_from_pg("2026-11-22 05:48:24+02"),
            "2026-11-22T05:48:24+02:00"
        );
        assert_eq!(
            rfc3339_from_pg("2026-11-22 05:48:24-05:30"),
            "2026-11-22T05:48:24-05:30"
        );
        assert_eq!(
            rfc3339_from_pg("2026-11-22 05:48:24"),
            "2026-11-22T05:48:24Z"
        );
    }

    #[test]
    fn commit_times_become_rfc3339() {
        assert_eq!(rfc3339_from_pg_micros(0), "2000-01-01T00:00:00.000000Z");
        // 2026-11-22T05:48:24.5Z is 1795326504.5 s after the Unix epoch.
        let micros = (1_795_326_504 - 946_684_800) * 1_000_000 + 500_000;
        assert_eq!(
            rfc3339_from_pg_micros(micros),
            "2026-11-22T05:48:24.500000Z"
        );
        assert_eq!(rfc3339_from_pg_micros(-1), "1999-12-31T23:59:59.999999Z");
    }

    #[test]
    fn text_that_is_not_utf8_is_refused_naming_the_column() {
        // A SQL_ASCII database can hand out any bytes as text.
        assert!(Text::new(Bytes::from_static(b"ok \xe2\x9c\x93")).is_ok());
        assert!(Text::new(Bytes::from_static(b"bad \xff")).is_err());
        let error = RowError::NotUtf8("aggregate_id".into()).to_string();
        assert_eq!(error, "column \"aggregate_id\" is not valid UTF-8");
    }

    #[test]
    fn bytea_hex_is_decoded() {
        assert_eq!(&decode_bytea(b"\\x00ff10", "p").unwrap()[..], &[0, 255, 16]);
        assert!(decode_bytea(b"\\x0", "p").is_err());
        assert!(decode_bytea(b"abc", "p").is_err());
    }
}
