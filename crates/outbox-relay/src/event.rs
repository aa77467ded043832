//! From a replicated row to an [`OutboxEvent`], through the configured column mapping.
//!
//! A [`Relation`] message describes a table's columns by position;
//! [`RowMapping::new`] resolves the configured column names to
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
use pgoutput::{Relation, TupleData, ValueRef};

/// A row's column values by position, in Postgres's text format: a pgoutput
/// tuple, or a row read with SQL (`column::text` under the same session
/// settings, so both print values identically).
pub(crate) trait Columns {
    /// The value at `index`, `None` past the end; borrowed from the row.
    fn value(&self, index: usize) -> Option<ValueRef<'_>>;
    /// How many columns.
    fn count(&self) -> usize;
    /// The values at `indices`, as [`value`](Self::value) gives each; in one
    /// pass where the row is encoded.
    fn values<const N: usize>(&self, indices: [usize; N]) -> [Option<ValueRef<'_>>; N] {
        indices.map(|i| self.value(i))
    }
    /// `slice`, which one of this row's values holds, as `Bytes`: sharing
    /// the row's buffer where it can, else a copy.
    fn share(&self, slice: &[u8]) -> Bytes;
}

impl Columns for TupleData {
    fn value(&self, index: usize) -> Option<ValueRef<'_>> {
        let [value] = self.get_many_ref([index]);
        value
    }
    fn values<const N: usize>(&self, indices: [usize; N]) -> [Option<ValueRef<'_>>; N] {
        self.get_many_ref(indices)
    }
    fn count(&self) -> usize {
        self.len()
    }
    fn share(&self, slice: &[u8]) -> Bytes {
        TupleData::share(self, slice)
    }
}

/// A row read with SQL, each column as text (`None` for NULL).
#[derive(Debug, Clone, Default)]
pub(crate) struct TextRow(pub Vec<Option<Bytes>>);

impl Columns for TextRow {
    fn value(&self, index: usize) -> Option<ValueRef<'_>> {
        self.0.get(index).map(|v| match v {
            Some(b) => ValueRef::Text(b),
            None => ValueRef::Null,
        })
    }
    fn count(&self) -> usize {
        self.0.len()
    }
    fn share(&self, slice: &[u8]) -> Bytes {
        let within = |b: &Bytes| {
            let (outer, inner) = (b.as_ptr_range(), slice.as_ptr_range());
            outer.start <= inner.start && inner.end <= outer.end
        };
        match self.0.iter().flatten().find(|b| within(b)) {
            Some(column) => column.slice_ref(slice),
            None => Bytes::copy_from_slice(slice),
        }
    }
}

use crate::config::columns::ColumnMapping;

/// Type OIDs the payload column may have.
mod oid {
    pub(super) const BYTEA: u32 = 17;
    pub(super) const TEXT: u32 = 25;
    pub(super) const JSON: u32 = 114;
    pub(super) const BPCHAR: u32 = 1042;
    pub(super) const VARCHAR: u32 = 1043;
    pub(super) const JSONB: u32 = 3802;
    /// `relay_txid`'s type (`postgres::outbox::derived::XID8_OID`).
    pub(super) const XID8: u32 = 5069;
}

/// The derived lifecycle's column (`postgres::outbox::derived::COLUMN`;
/// named here too, since the ground imports nothing from the wings above).
const TXID_COLUMN: &str = "relay_txid";

/// UTF-8 text that shares the replication message's buffer.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Text(Bytes);

impl Text {
    /// Checks `bytes` are UTF-8.
    pub fn new(bytes: Bytes) -> Result<Self, std::str::Utf8Error> {
        std::str::from_utf8(&bytes)?;
        Ok(Self(bytes))
    }

    /// `text`'s bytes as `share` gives them (sharing the buffer `text`
    /// lies in, or a copy), without checking them again.
    fn shared(text: &str, share: impl FnOnce(&[u8]) -> Bytes) -> Self {
        let bytes = share(text.as_bytes());
        // The same memory (the usual case, a pointer comparison) or the same
        // bytes: UTF-8 either way.
        assert!(
            (bytes.as_ptr() == text.as_ptr() && bytes.len() == text.len())
                || bytes == text.as_bytes(),
            "shared text differs from its source"
        );
        Self(bytes)
    }

    /// The text.
    #[allow(unsafe_code)]
    pub fn as_str(&self) -> &str {
        // SAFETY: `new`, `shared` and `From<String>`/`From<&str>` are the only
        // constructors, and each one holds valid UTF-8 (`shared` asserts it
        // holds a `&str`'s bytes); `Bytes` is immutable.
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
///
/// Its text fields live in one string, one after another, and the event
/// keeps where each one lies: one allocation an event, and nothing that
/// counts references to the replication message it came from (the payload
/// alone shares that buffer). Read them with the accessors.
#[derive(Clone)]
pub struct OutboxEvent {
    text: String,
    id: Span,
    aggregate_type: Span,
    aggregate_id: Span,
    event_type: Span,
    group: Span,
    time: Span,
    headers: Option<Span>,
    topic: Option<Span>,
    /// The payload.
    pub payload: Payload,
    /// The writing transaction's top-level id, from the row's `relay_txid`
    /// column (`postgres::outbox::derived::COLUMN`) when the table has it
    /// and the row carries one: whether the stream must mark the row it
    /// published (`derived::Holes::needs_mark`).
    /// Never in the envelope nor in message attributes.
    pub txid: Option<u64>,
}

/// Where a field lies in [`OutboxEvent`]'s text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Span {
    start: u32,
    end: u32,
}

/// An event's text fields, borrowed: what [`OutboxEvent::new`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fields<'a> {
    /// Event id: the envelope id and the deduplication id.
    pub id: &'a str,
    /// Aggregate type.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: &'a str,
    /// Event type.
    pub event_type: &'a str,
    /// Ordering group (FIFO MessageGroupId).
    pub group: &'a str,
    /// When the event happened, RFC 3339.
    pub time: &'a str,
    /// Headers, a JSON object, when present.
    pub headers: Option<&'a str>,
    /// Per-row topic override.
    pub topic: Option<&'a str>,
}

/// Appends fields to an event's text.
struct TextBuilder(String);

impl TextBuilder {
    fn push(&mut self, field: &str) -> Span {
        self.push_with(|text| text.push_str(field))
    }

    fn push_with(&mut self, write: impl FnOnce(&mut String)) -> Span {
        let start = self.0.len();
        write(&mut self.0);
        // Postgres values are at most 1 GB; an event's text fits in u32.
        let at = |n: usize| u32::try_from(n).expect("an event's text is under 4 GiB");
        Span {
            start: at(start),
            end: at(self.0.len()),
        }
    }
}

impl OutboxEvent {
    /// An event of `fields` (copied) and `payload`.
    pub fn new(fields: Fields<'_>, payload: Payload) -> Self {
        let Fields {
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            group,
            time,
            headers,
            topic,
        } = fields;
        let len = [id, aggregate_type, aggregate_id, event_type, group, time]
            .iter()
            .chain(headers.iter())
            .chain(topic.iter())
            .map(|f| f.len())
            .sum();
        let mut text = TextBuilder(String::with_capacity(len));
        Self {
            id: text.push(id),
            aggregate_type: text.push(aggregate_type),
            aggregate_id: text.push(aggregate_id),
            event_type: text.push(event_type),
            group: text.push(group),
            time: text.push(time),
            headers: headers.map(|h| text.push(h)),
            topic: topic.map(|t| text.push(t)),
            payload,
            txid: None,
            text: text.0,
        }
    }

    fn field(&self, span: Span) -> &str {
        &self.text[span.start as usize..span.end as usize]
    }

    /// Event id: the envelope id and the deduplication id.
    pub fn id(&self) -> &str {
        self.field(self.id)
    }

    /// Aggregate type.
    pub fn aggregate_type(&self) -> &str {
        self.field(self.aggregate_type)
    }

    /// Aggregate id.
    pub fn aggregate_id(&self) -> &str {
        self.field(self.aggregate_id)
    }

    /// Event type.
    pub fn event_type(&self) -> &str {
        self.field(self.event_type)
    }

    /// Ordering group (FIFO MessageGroupId): `columns.group`, default the aggregate id.
    pub fn group(&self) -> &str {
        self.field(self.group)
    }

    /// When the event happened, RFC 3339; the commit time when the table has no such column.
    pub fn time(&self) -> &str {
        self.field(self.time)
    }

    /// Headers, a JSON object (text of a jsonb/json column), when present.
    pub fn headers(&self) -> Option<&str> {
        self.headers.map(|s| self.field(s))
    }

    /// Per-row topic override.
    pub fn topic(&self) -> Option<&str> {
        self.topic.map(|s| self.field(s))
    }

    /// Put the event in another ordering group.
    pub fn set_group(&mut self, group: &str) {
        let mut text = TextBuilder(std::mem::take(&mut self.text));
        self.group = text.push(group);
        self.text = text.0;
    }

    /// Give the event another id (a notice about it is other content, so it
    /// carries an id of its own: DESIGN.md invariant 10).
    pub fn set_id(&mut self, id: &str) {
        let mut text = TextBuilder(std::mem::take(&mut self.text));
        self.id = text.push(id);
        self.text = text.0;
    }

    /// Every text field, borrowed.
    pub fn fields(&self) -> Fields<'_> {
        Fields {
            id: self.id(),
            aggregate_type: self.aggregate_type(),
            aggregate_id: self.aggregate_id(),
            event_type: self.event_type(),
            group: self.group(),
            time: self.time(),
            headers: self.headers(),
            topic: self.topic(),
        }
    }
}

impl fmt::Debug for OutboxEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxEvent")
            .field("fields", &self.fields())
            .field("payload", &self.payload)
            .finish()
    }
}

/// Equal when every field and the payload are: not how the text is laid out.
impl PartialEq for OutboxEvent {
    fn eq(&self, other: &Self) -> bool {
        self.fields() == other.fields() && self.payload == other.payload
    }
}

impl Eq for OutboxEvent {}

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
pub(crate) enum RowError {
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
pub(crate) struct RowMapping {
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
    /// The derived lifecycle's `relay_txid` (`xid8`), when the table has it.
    txid: Option<Slot>,
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
    pub(crate) fn new(relation: &Relation, columns: &ColumnMapping) -> Result<Self, MappingError> {
        let table = format!("{}.{}", relation.namespace, relation.name);
        let described: Vec<(&str, u32)> = relation
            .columns
            .iter()
            .map(|c| (c.name.as_str(), c.type_oid))
            .collect();
        Self::from_columns(&table, &described, columns)
    }

    /// Resolve `columns` against a table's `(name, type oid)` columns, in order.
    pub(crate) fn from_columns(
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
        let txid = described
            .iter()
            .position(|(n, t)| *n == TXID_COLUMN && *t == oid::XID8)
            .map(|index| Slot {
                index,
                name: TXID_COLUMN.to_owned(),
            });
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
            txid,
            absent_optional,
        })
    }

    /// The event id alone, for naming a row that failed to map.
    pub(crate) fn id_of(&self, tuple: &impl Columns) -> Option<String> {
        match tuple.value(self.id.index) {
            Some(ValueRef::Text(b)) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    /// Build the event from an inserted row; `commit_time` (µs since
    /// 2000-01-01) stands in for a missing `created_at`.
    pub(crate) fn event(
        &self,
        tuple: &impl Columns,
        commit_time: i64,
    ) -> Result<OutboxEvent, RowError> {
        // Every field in one pass over the row; a field not configured asks
        // for a column past the end and gets `None`.
        let index = |slot: Option<&Slot>| slot.map_or(usize::MAX, |s| s.index);
        let [id, aggregate_type, aggregate_id, event_type, payload, created_at, group, headers, topic, txid] =
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
                index(self.txid.as_ref()),
            ]);
        // NULL (a row from before the migration, or a forged NULL) or
        // unreadable: no id, so the row keeps explicit states.
        let txid = match txid {
            Some(ValueRef::Text(b)) => std::str::from_utf8(b).ok().and_then(|t| t.parse().ok()),
            _ => None,
        };
        let count = tuple.count();
        let payload = match self.payload_kind {
            PayloadKind::Json => Payload::Json(shared_text(tuple, payload, count, &self.payload)?),
            PayloadKind::Text => Payload::Text(shared_text(tuple, payload, count, &self.payload)?),
            PayloadKind::Binary => Payload::Binary(decode_bytea(
                raw(payload, count, &self.payload)?,
                &self.payload.name,
            )?),
        };
        let created_at = optional_text(created_at, count, self.created_at.as_ref())?;
        let aggregate_id = text(aggregate_id, count, &self.aggregate_id)?;
        let group = self
            .group
            .as_ref()
            .map(|slot| text(group, count, slot))
            .transpose()?;
        let id = text(id, count, &self.id)?;
        let aggregate_type = text(aggregate_type, count, &self.aggregate_type)?;
        let event_type = text(event_type, count, &self.event_type)?;
        let headers = optional_text(headers, count, self.headers.as_ref())?;
        let topic = optional_text(topic, count, self.topic.as_ref())?.filter(|t| !t.is_empty());

        // Room for every field, and the time's few extra bytes.
        let len = [id, aggregate_type, aggregate_id, event_type]
            .iter()
            .chain(group.iter())
            .chain(headers.iter())
            .chain(topic.iter())
            .map(|f| f.len())
            .sum::<usize>()
            + created_at.map_or(0, str::len)
            + 32;
        let mut text = TextBuilder(String::with_capacity(len));
        let aggregate_id = text.push(aggregate_id);
        Ok(OutboxEvent {
            time: text.push_with(|out| match created_at {
                Some(t) => rfc3339_from_pg_into(t, out),
                None => rfc3339_from_pg_micros_into(commit_time, out),
            }),
            group: match group {
                Some(g) => text.push(g),
                None => aggregate_id,
            },
            aggregate_id,
            id: text.push(id),
            aggregate_type: text.push(aggregate_type),
            event_type: text.push(event_type),
            headers: headers.map(|h| text.push(h)),
            topic: topic.map(|t| text.push(t)),
            payload,
            txid,
            text: text.0,
        })
    }
}

/// The column's value as text bytes; `value` is what the row holds at the
/// slot's position (`None`: the row has only `count` columns).
fn raw<'a>(value: Option<ValueRef<'a>>, count: usize, slot: &Slot) -> Result<&'a [u8], RowError> {
    match value.ok_or_else(|| RowError::ShortRow {
        got: count,
        column: slot.name.clone(),
    })? {
        ValueRef::Text(b) => Ok(b),
        ValueRef::Null => Err(RowError::Null(slot.name.clone())),
        ValueRef::UnchangedToast => Err(RowError::Unexpected {
            column: slot.name.clone(),
            kind: "an unchanged TOAST value",
        }),
        ValueRef::Binary(_) => Err(RowError::Unexpected {
            column: slot.name.clone(),
            kind: "a binary value",
        }),
    }
}

fn text<'a>(value: Option<ValueRef<'a>>, count: usize, slot: &Slot) -> Result<&'a str, RowError> {
    std::str::from_utf8(raw(value, count, slot)?).map_err(|_| RowError::NotUtf8(slot.name.clone()))
}

/// [`text`], as a [`Text`] sharing the row's buffer.
fn shared_text(
    row: &impl Columns,
    value: Option<ValueRef<'_>>,
    count: usize,
    slot: &Slot,
) -> Result<Text, RowError> {
    let text = text(value, count, slot)?;
    // Checked above: `Text::new` would check it again.
    Ok(Text::shared(text, |bytes| row.share(bytes)))
}

fn optional_text<'a>(
    value: Option<ValueRef<'a>>,
    count: usize,
    slot: Option<&Slot>,
) -> Result<Option<&'a str>, RowError> {
    let Some(slot) = slot else { return Ok(None) };
    if matches!(value, Some(ValueRef::Null)) {
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
#[cfg(test)]
pub(crate) fn rfc3339_from_pg(pg: &str) -> String {
    // Room for ":00".
    let mut out = String::with_capacity(pg.len() + 3);
    rfc3339_from_pg_into(pg, &mut out);
    out
}

/// Postgres `timestamptz` text (ISO DateStyle) to RFC 3339, appended to
/// `out`; a `timestamp` without zone is taken as UTC.
fn rfc3339_from_pg_into(pg: &str, out: &mut String) {
    let begin = out.len();
    // The first space (between date and time) becomes a `T`.
    match pg.split_once(' ') {
        Some((date, time)) => {
            out.push_str(date);
            out.push('T');
            out.push_str(time);
        }
        None => out.push_str(pg),
    }
    // The zone starts at the last '+' or '-' after the time part.
    let time_start = out[begin..].find('T').map_or(begin, |i| begin + i + 1);
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
}

/// Microseconds since 2000-01-01 UTC (Postgres epoch) to RFC 3339 in UTC.
#[cfg(test)]
pub(crate) fn rfc3339_from_pg_micros(micros: i64) -> String {
    let mut out = String::with_capacity(27);
    rfc3339_from_pg_micros_into(micros, &mut out);
    out
}

/// Microseconds since 2000-01-01 UTC (Postgres epoch) to RFC 3339 in UTC,
/// appended to `out`.
fn rfc3339_from_pg_micros_into(micros: i64, out: &mut String) {
    use std::fmt::Write;
    let (secs, frac) = crate::time::unix_secs_from_pg_micros(micros);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    // Writing to a `String` cannot fail.
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{frac:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
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

/// Where a relay's events come from: the database cluster (its system
/// identifier, which a promoted standby keeps), the database and the outbox
/// table. A sink that names things it stores for later (claim-check objects)
/// namespaces them by it, so two tables or relays sharing a bucket never name
/// one object for two events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// `pg_control_system().system_identifier` / `IDENTIFY_SYSTEM`'s systemid.
    pub system: String,
    /// The database's name.
    pub database: String,
    /// The outbox table, `schema.table`.
    pub table: String,
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

    /// The row's `relay_txid` rides with the event when the table has the
    /// column as `xid8`; NULL, another type or no column: no id.
    #[test]
    fn the_transaction_id_is_read_from_an_xid8_relay_txid_column_only() {
        assert_eq!(TXID_COLUMN, crate::postgres::outbox::derived::COLUMN);
        assert_eq!(oid::XID8, crate::postgres::outbox::derived::XID8_OID);
        let base = [
            ("id", oid::TEXT),
            ("aggregate_type", oid::TEXT),
            ("aggregate_id", oid::TEXT),
            ("event_type", oid::TEXT),
            ("payload", oid::JSONB),
        ];
        let column = |s: &'static str| Some(Bytes::from_static(s.as_bytes()));
        let row = |txid: Option<Bytes>| {
            TextRow(vec![
                column("e-1"),
                column("order"),
                column("o-1"),
                column("OrderCreated"),
                column("{}"),
                txid,
            ])
        };
        let with = |type_oid: u32| {
            let mut described = base.to_vec();
            described.push(("relay_txid", type_oid));
            RowMapping::from_columns("public.outbox", &described, &ColumnMapping::default())
                .unwrap()
        };
        let xid8 = with(oid::XID8);
        assert_eq!(
            xid8.event(&row(column("4294967301")), 0).unwrap().txid,
            Some(4_294_967_301)
        );
        assert_eq!(xid8.event(&row(None), 0).unwrap().txid, None);
        assert_eq!(
            with(oid::TEXT).event(&row(column("7")), 0).unwrap().txid,
            None
        );
        let without =
            RowMapping::from_columns("public.outbox", &base, &ColumnMapping::default()).unwrap();
        assert_eq!(without.event(&row(column("7")), 0).unwrap().txid, None);
    }

    /// A mapped row reads back field by field as the row held it: each span
    /// lands on its own field, the group shares the aggregate id's, the time
    /// is rewritten, an empty topic is none, and the payload shares the row.
    #[test]
    fn a_mapped_row_reads_back_field_by_field() {
        let described = [
            ("id", oid::TEXT),
            ("aggregate_type", oid::TEXT),
            ("aggregate_id", oid::TEXT),
            ("event_type", oid::TEXT),
            ("payload", oid::JSONB),
            ("headers", oid::JSONB),
            ("topic", oid::TEXT),
            ("created_at", 1184),
        ];
        let mapping =
            RowMapping::from_columns("public.outbox", &described, &ColumnMapping::default())
                .unwrap();
        let column = |s: &'static str| Some(Bytes::from_static(s.as_bytes()));
        let row = TextRow(vec![
            column("e-1"),
            column("order"),
            column("ord-\u{e9}T+1"),
            column("OrderCreated"),
            column(r#"{"a": 1}"#),
            None,
            column(""),
            column("2026-11-22 05:48:24.5"),
        ]);
        let event = mapping.event(&row, 0).unwrap();
        let expected = OutboxEvent::new(
            Fields {
                id: "e-1",
                aggregate_type: "order",
                aggregate_id: "ord-\u{e9}T+1",
                event_type: "OrderCreated",
                group: "ord-\u{e9}T+1",
                time: "2026-11-22T05:48:24.5Z",
                headers: None,
                topic: None,
            },
            Payload::Json(r#"{"a": 1}"#.into()),
        );
        assert_eq!(event, expected);
        assert_eq!(event.time(), "2026-11-22T05:48:24.5Z");
        let Payload::Json(payload) = &event.payload else {
            panic!("a jsonb payload")
        };
        assert_eq!(
            payload.bytes().as_ptr(),
            row.0[4].as_ref().unwrap().as_ptr()
        );

        let mut moved = event.clone();
        moved.set_group("dead-letters");
        assert_eq!(moved.group(), "dead-letters");
        assert_eq!(moved.aggregate_id(), event.aggregate_id());
        assert_ne!(moved, event);
    }

    #[test]
    fn bytea_hex_is_decoded() {
        assert_eq!(&decode_bytea(b"\\x00ff10", "p").unwrap()[..], &[0, 255, 16]);
        assert!(decode_bytea(b"\\x0", "p").is_err());
        assert!(decode_bytea(b"abc", "p").is_err());
    }
}
