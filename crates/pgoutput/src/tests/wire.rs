//! Test-only writer of the wire format: a byte-level builder for hand-made
//! messages and an encoder of whole [`Message`]s for round-trip tests.

use bytes::Bytes;

use crate::{Message, OldTuple, Prepare, TupleData, Value};

/// Appends big-endian fields to a growing message.
#[derive(Default)]
pub(super) struct Wire(Vec<u8>);

impl Wire {
    /// A message starting with type byte `kind`.
    pub(super) fn msg(kind: u8) -> Self {
        Self(vec![kind])
    }

    pub(super) fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }

    pub(super) fn u16(mut self, v: u16) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn i32(mut self, v: i32) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub(super) fn raw(mut self, bytes: &[u8]) -> Self {
        self.0.extend_from_slice(bytes);
        self
    }

    /// A NUL-terminated string.
    pub(super) fn str(self, s: &str) -> Self {
        self.raw(s.as_bytes()).u8(0)
    }

    /// A TupleData: count, then each value.
    pub(super) fn values(self, values: &[Value]) -> Self {
        let count = u16::try_from(values.len()).expect("test tuple too long");
        values.iter().fold(self.u16(count), Wire::value)
    }

    pub(super) fn value(self, value: &Value) -> Self {
        match value {
            Value::Null => self.u8(b'n'),
            Value::UnchangedToast => self.u8(b'u'),
            Value::Text(b) => self.u8(b't').len(b).raw(b),
            Value::Binary(b) => self.u8(b'b').len(b).raw(b),
        }
    }

    fn len(self, b: &[u8]) -> Self {
        self.i32(i32::try_from(b.len()).expect("test value too long"))
    }

    fn tuple(self, tuple: &TupleData) -> Self {
        let count = u16::try_from(tuple.len()).expect("tuple count fits");
        self.u16(count).raw(tuple.raw_columns())
    }

    fn old(self, old: &OldTuple) -> Self {
        match old {
            OldTuple::Key(t) => self.u8(b'K').tuple(t),
            OldTuple::Full(t) => self.u8(b'O').tuple(t),
        }
    }

    fn prepare(self, m: &Prepare) -> Self {
        self.u8(m.flags)
            .u64(m.prepare_lsn)
            .u64(m.end_lsn)
            .i64(m.prepare_time)
            .u32(m.xid)
            .str(&m.gid)
    }

    pub(super) fn build(self) -> Bytes {
        Bytes::from(self.0)
    }

    pub(super) fn into_vec(self) -> Vec<u8> {
        self.0
    }
}

/// A [`TupleData`] holding `values`, as `decode` would produce it.
pub(super) fn tuple(values: &[Value]) -> TupleData {
    let count = u16::try_from(values.len()).expect("test tuple too long");
    let columns = values.iter().fold(Wire::default(), Wire::value).build();
    TupleData::from_raw(count, columns)
}

/// Encodes `message` exactly as pgoutput would (protocol version 1, or 3
/// with `two_phase`).
pub(super) fn encode(message: &Message) -> Vec<u8> {
    let w = match message {
        Message::Begin(m) => Wire::msg(b'B')
            .u64(m.final_lsn)
            .i64(m.commit_time)
            .u32(m.xid),
        Message::Commit(m) => Wire::msg(b'C')
            .u8(m.flags)
            .u64(m.commit_lsn)
            .u64(m.end_lsn)
            .i64(m.commit_time),
        Message::Origin(m) => Wire::msg(b'O').u64(m.commit_lsn).str(&m.name),
        Message::Relation(m) => {
            let count = u16::try_from(m.columns.len()).expect("column count fits");
            let head = Wire::msg(b'R')
                .u32(m.oid)
                .str(&m.namespace)
                .str(&m.name)
                .u8(m.replica_identity)
                .u16(count);
            m.columns.iter().fold(head, |w, c| {
                w.u8(c.flags)
                    .str(&c.name)
                    .u32(c.type_oid)
                    .i32(c.type_modifier)
            })
        }
        Message::Type(m) => Wire::msg(b'Y').u32(m.oid).str(&m.namespace).str(&m.name),
        Message::Insert(m) => Wire::msg(b'I').u32(m.relation_oid).u8(b'N').tuple(&m.tuple),
        Message::Update(m) => {
            let w = Wire::msg(b'U').u32(m.relation_oid);
            let w = match &m.old {
                None => w,
                Some(old) => w.old(old),
            };
            w.u8(b'N').tuple(&m.new)
        }
        Message::Delete(m) => Wire::msg(b'D').u32(m.relation_oid).old(&m.old),
        Message::Truncate(m) => {
            let count = i32::try_from(m.relation_oids.len()).expect("oid count fits");
            let head = Wire::msg(b'T').i32(count).u8(m.options);
            m.relation_oids.iter().fold(head, |w, &oid| w.u32(oid))
        }
        Message::Message(m) => Wire::msg(b'M')
            .u8(u8::from(m.transactional))
            .u64(m.lsn)
            .str(&m.prefix)
            .len(&m.content)
            .raw(&m.content),
        Message::BeginPrepare(m) => Wire::msg(b'b')
            .u64(m.prepare_lsn)
            .u64(m.end_lsn)
            .i64(m.prepare_time)
            .u32(m.xid)
            .str(&m.gid),
        Message::Prepare(m) => Wire::msg(b'P').prepare(m),
        Message::StreamPrepare(m) => Wire::msg(b'p').prepare(m),
        Message::CommitPrepared(m) => Wire::msg(b'K')
            .u8(m.flags)
            .u64(m.commit_lsn)
            .u64(m.end_lsn)
            .i64(m.commit_time)
            .u32(m.xid)
            .str(&m.gid),
        Message::RollbackPrepared(m) => Wire::msg(b'r')
            .u8(m.flags)
            .u64(m.prepare_end_lsn)
            .u64(m.rollback_end_lsn)
            .i64(m.prepare_time)
            .i64(m.rollback_time)
            .u32(m.xid)
            .str(&m.gid),
    };
    w.into_vec()
}
