//! [`decode`]: from one message buffer to a [`Message`].

use bytes::Bytes;

use crate::reader::{Reader, NEGATIVE_COUNT, NEGATIVE_LENGTH};
use crate::{
    Begin, BeginPrepare, Column, Commit, CommitPrepared, DecodeError, Delete, Insert,
    LogicalMessage, Message, OldTuple, Origin, Prepare, Relation, RollbackPrepared, Truncate,
    TupleData, Type, Update,
};

const UNKNOWN_TUPLE_MARKER: &str = "unknown tuple marker";

/// Smallest encoding of a relation column: flags, empty name, type OID,
/// type modifier.
const MIN_COLUMN_LEN: usize = 1 + 1 + 4 + 4;
/// Encoding of one OID in a Truncate message.
const OID_LEN: usize = 4;

/// Decodes one pgoutput message (protocol version 1, or 3 with `two_phase`
/// and without `streaming`): the payload of one `XLogData` CopyData
/// message, starting with the message type byte.
///
/// The whole buffer must be exactly one message; see the
/// [crate documentation](crate) for what is validated. Values and contents
/// in the result are slices of `buf`.
///
/// # Errors
///
/// [`DecodeError::Empty`] for an empty buffer,
/// [`DecodeError::UnknownMessage`] for a type byte that is none of the
/// messages above (streaming's among them), [`DecodeError::Truncated`] when the buffer ends inside
/// a field and [`DecodeError::Invalid`] for a malformed field or trailing
/// bytes.
pub fn decode(buf: Bytes) -> Result<Message, DecodeError> {
    let Some(&kind) = buf.first() else {
        return Err(DecodeError::Empty);
    };
    let name = match kind {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        b'b' => "Begin Prepare",
        b'P' => "Prepare",
        b'K' => "Commit Prepared",
        b'r' => "Rollback Prepared",
        b'p' => "Stream Prepare",
        other => return Err(DecodeError::UnknownMessage(other)),
    };
    let mut r = Reader::new(&buf, 1, name);
    let message = match kind {
        b'B' => Message::Begin(begin(&mut r)?),
        b'C' => Message::Commit(commit(&mut r)?),
        b'O' => Message::Origin(origin(&mut r)?),
        b'R' => Message::Relation(relation(&mut r)?),
        b'Y' => Message::Type(type_(&mut r)?),
        b'I' => Message::Insert(insert(&buf, &mut r)?),
        b'U' => Message::Update(update(&buf, &mut r)?),
        b'D' => Message::Delete(delete(&buf, &mut r)?),
        b'T' => Message::Truncate(truncate(&mut r)?),
        b'M' => Message::Message(logical_message(&buf, &mut r)?),
        b'b' => Message::BeginPrepare(begin_prepare(&mut r)?),
        b'P' => Message::Prepare(prepare(&mut r)?),
        b'K' => Message::CommitPrepared(commit_prepared(&mut r)?),
        b'r' => Message::RollbackPrepared(rollback_prepared(&mut r)?),
        _ => Message::StreamPrepare(prepare(&mut r)?),
    };
    r.finish()?;
    Ok(message)
}

fn begin(r: &mut Reader<'_>) -> Result<Begin, DecodeError> {
    Ok(Begin {
        final_lsn: r.u64()?,
        commit_time: r.i64()?,
        xid: r.u32()?,
    })
}

fn commit(r: &mut Reader<'_>) -> Result<Commit, DecodeError> {
    Ok(Commit {
        flags: r.u8()?,
        commit_lsn: r.u64()?,
        end_lsn: r.u64()?,
        commit_time: r.i64()?,
    })
}

fn origin(r: &mut Reader<'_>) -> Result<Origin, DecodeError> {
    Ok(Origin {
        commit_lsn: r.u64()?,
        name: r.string()?,
    })
}

fn relation(r: &mut Reader<'_>) -> Result<Relation, DecodeError> {
    let oid = r.u32()?;
    let namespace = r.string()?;
    let name = r.string()?;
    let replica_identity = r.u8()?;
    let count = usize::from(r.u16()?);
    let mut columns = Vec::with_capacity(count.min(r.remaining() / MIN_COLUMN_LEN));
    for _ in 0..count {
        columns.push(Column {
            flags: r.u8()?,
            name: r.string()?,
            type_oid: r.u32()?,
            type_modifier: r.i32()?,
        });
    }
    Ok(Relation {
        oid,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn type_(r: &mut Reader<'_>) -> Result<Type, DecodeError> {
    Ok(Type {
        oid: r.u32()?,
        namespace: r.string()?,
        name: r.string()?,
    })
}

fn insert(buf: &Bytes, r: &mut Reader<'_>) -> Result<Insert, DecodeError> {
    let relation_oid = r.u32()?;
    expect_new_marker(r)?;
    Ok(Insert {
        relation_oid,
        tuple: TupleData::read(buf, r)?,
    })
}

fn update(buf: &Bytes, r: &mut Reader<'_>) -> Result<Update, DecodeError> {
    let relation_oid = r.u32()?;
    let offset = r.pos();
    let old = match r.u8()? {
        b'K' => Some(OldTuple::Key(TupleData::read(buf, r)?)),
        b'O' => Some(OldTuple::Full(TupleData::read(buf, r)?)),
        b'N' => None,
        _ => return Err(r.invalid(offset, UNKNOWN_TUPLE_MARKER)),
    };
    if old.is_some() {
        expect_new_marker(r)?;
    }
    Ok(Update {
        relation_oid,
        old,
        new: TupleData::read(buf, r)?,
    })
}

fn delete(buf: &Bytes, r: &mut Reader<'_>) -> Result<Delete, DecodeError> {
    let relation_oid = r.u32()?;
    let offset = r.pos();
    let old = match r.u8()? {
        b'K' => OldTuple::Key(TupleData::read(buf, r)?),
        b'O' => OldTuple::Full(TupleData::read(buf, r)?),
        _ => return Err(r.invalid(offset, UNKNOWN_TUPLE_MARKER)),
    };
    Ok(Delete { relation_oid, old })
}

fn truncate(r: &mut Reader<'_>) -> Result<Truncate, DecodeError> {
    let count = r.non_negative_i32(NEGATIVE_COUNT)?;
    let options = r.u8()?;
    // Check the whole list fits before allocating for it.
    r.ensure(count.saturating_mul(OID_LEN))?;
    let mut relation_oids = Vec::with_capacity(count);
    for _ in 0..count {
        relation_oids.push(r.u32()?);
    }
    Ok(Truncate {
        options,
        relation_oids,
    })
}

fn logical_message(buf: &Bytes, r: &mut Reader<'_>) -> Result<LogicalMessage, DecodeError> {
    let flags = r.u8()?;
    let lsn = r.u64()?;
    let prefix = r.string()?;
    let len = r.non_negative_i32(NEGATIVE_LENGTH)?;
    let content = buf.slice(r.range(len)?);
    Ok(LogicalMessage {
        transactional: flags & 1 != 0,
        lsn,
        prefix,
        content,
    })
}

fn begin_prepare(r: &mut Reader<'_>) -> Result<BeginPrepare, DecodeError> {
    Ok(BeginPrepare {
        prepare_lsn: r.u64()?,
        end_lsn: r.u64()?,
        prepare_time: r.i64()?,
        xid: r.u32()?,
        gid: r.string()?,
    })
}

fn prepare(r: &mut Reader<'_>) -> Result<Prepare, DecodeError> {
    Ok(Prepare {
        flags: r.u8()?,
        prepare_lsn: r.u64()?,
        end_lsn: r.u64()?,
        prepare_time: r.i64()?,
        xid: r.u32()?,
        gid: r.string()?,
    })
}

fn commit_prepared(r: &mut Reader<'_>) -> Result<CommitPrepared, DecodeError> {
    Ok(CommitPrepared {
        flags: r.u8()?,
        commit_lsn: r.u64()?,
        end_lsn: r.u64()?,
        commit_time: r.i64()?,
        xid: r.u32()?,
        gid: r.string()?,
    })
}

fn rollback_prepared(r: &mut Reader<'_>) -> Result<RollbackPrepared, DecodeError> {
    Ok(RollbackPrepared {
        flags: r.u8()?,
        prepare_end_lsn: r.u64()?,
        rollback_end_lsn: r.u64()?,
        prepare_time: r.i64()?,
        rollback_time: r.i64()?,
        xid: r.u32()?,
        gid: r.string()?,
    })
}

fn expect_new_marker(r: &mut Reader<'_>) -> Result<(), DecodeError> {
    let offset = r.pos();
    match r.u8()? {
        b'N' => Ok(()),
        _ => Err(r.invalid(offset, UNKNOWN_TUPLE_MARKER)),
    }
}
