//! The decoded pgoutput messages.

use bytes::Bytes;

use crate::TupleData;

/// One decoded pgoutput message (protocol version 1, or 3 with `two_phase`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// `'B'`: a transaction starts.
    Begin(Begin),
    /// `'C'`: a transaction commits.
    Commit(Commit),
    /// `'O'`: the transaction was replicated from another origin.
    Origin(Origin),
    /// `'R'`: schema of a relation used by following row messages.
    Relation(Relation),
    /// `'Y'`: name of a non-built-in data type used by a relation.
    Type(Type),
    /// `'I'`: a row was inserted.
    Insert(Insert),
    /// `'U'`: a row was updated.
    Update(Update),
    /// `'D'`: a row was deleted.
    Delete(Delete),
    /// `'T'`: relations were truncated.
    Truncate(Truncate),
    /// `'M'`: a message written with `pg_logical_emit_message`.
    Message(LogicalMessage),
    /// `'b'`: a transaction being prepared for two-phase commit starts
    /// (its changes follow, then [`Message::Prepare`]).
    BeginPrepare(BeginPrepare),
    /// `'P'`: the transaction begun by [`Message::BeginPrepare`] was
    /// prepared (`PREPARE TRANSACTION`); it is neither committed nor
    /// rolled back yet.
    Prepare(Prepare),
    /// `'K'`: a prepared transaction was committed (`COMMIT PREPARED`).
    CommitPrepared(CommitPrepared),
    /// `'r'`: a prepared transaction was rolled back (`ROLLBACK PREPARED`).
    RollbackPrepared(RollbackPrepared),
    /// `'p'`: a streamed transaction was prepared. Sent only with both
    /// `streaming` and `two_phase`; the same fields as [`Message::Prepare`].
    StreamPrepare(Prepare),
}

/// `'B'`: start of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// LSN of the transaction's commit record.
    pub final_lsn: u64,
    /// Commit time in microseconds since 2000-01-01 00:00 UTC.
    pub commit_time: i64,
    /// Transaction id.
    pub xid: u32,
}

/// `'C'`: end of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Flags; currently unused by PostgreSQL (0).
    pub flags: u8,
    /// LSN of the commit record.
    pub commit_lsn: u64,
    /// LSN just past the end of the transaction; the position to confirm.
    pub end_lsn: u64,
    /// Commit time in microseconds since 2000-01-01 00:00 UTC.
    pub commit_time: i64,
}

/// `'O'`: the current transaction originated on another server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// LSN of the commit on the origin server.
    pub commit_lsn: u64,
    /// Name of the replication origin.
    pub name: String,
}

/// `'R'`: description of a relation, sent before its first row message and
/// again whenever its schema changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// OID of the relation, as referenced by row messages.
    pub oid: u32,
    /// Schema name; empty for `pg_catalog`.
    pub namespace: String,
    /// Relation name.
    pub name: String,
    /// `pg_class.relreplident`: `b'd'` default, `b'n'` nothing,
    /// `b'f'` full, `b'i'` index.
    pub replica_identity: u8,
    /// The published columns, in row image order.
    pub columns: Vec<Column>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Column flags; bit 1 marks a replica identity (key) column.
    pub flags: u8,
    /// Column name.
    pub name: String,
    /// OID of the column's data type.
    pub type_oid: u32,
    /// Type modifier (`atttypmod`), -1 when none.
    pub type_modifier: i32,
}

impl Column {
    /// Whether the column is part of the relation's replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

/// `'Y'`: description of a data type used by a following relation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Type {
    /// OID of the type.
    pub oid: u32,
    /// Schema name; empty for `pg_catalog`.
    pub namespace: String,
    /// Type name.
    pub name: String,
}

/// `'I'`: a new row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    /// OID of the [`Relation`] the row belongs to.
    pub relation_oid: u32,
    /// The new row (`'N'`).
    pub tuple: TupleData,
}

/// `'U'`: a changed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    /// OID of the [`Relation`] the row belongs to.
    pub relation_oid: u32,
    /// The old key or old row, sent only when the key changed or the
    /// relation has `REPLICA IDENTITY FULL`.
    pub old: Option<OldTuple>,
    /// The new row (`'N'`); unchanged TOASTed columns are
    /// [`Value::UnchangedToast`](crate::Value::UnchangedToast).
    pub new: TupleData,
}

/// `'D'`: a removed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    /// OID of the [`Relation`] the row belonged to.
    pub relation_oid: u32,
    /// The old key or old row.
    pub old: OldTuple,
}

/// The old image of an updated or deleted row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// `'K'`: only the replica identity key columns are set; the others are
    /// [`Value::Null`](crate::Value::Null).
    Key(TupleData),
    /// `'O'`: the full old row (`REPLICA IDENTITY FULL`).
    Full(TupleData),
}

impl OldTuple {
    /// The row image, whichever kind it is.
    pub fn tuple(&self) -> &TupleData {
        match self {
            Self::Key(tuple) | Self::Full(tuple) => tuple,
        }
    }
}

/// `'T'`: relations were truncated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Option bits: 1 = `CASCADE`, 2 = `RESTART IDENTITY`.
    pub options: u8,
    /// OIDs of the truncated relations.
    pub relation_oids: Vec<u32>,
}

impl Truncate {
    /// Whether `TRUNCATE ... CASCADE` was used.
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }

    /// Whether `TRUNCATE ... RESTART IDENTITY` was used.
    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }
}

/// `'M'`: a logical decoding message (`pg_logical_emit_message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalMessage {
    /// Whether the message was emitted transactionally (inside the
    /// surrounding Begin/Commit) rather than immediately.
    pub transactional: bool,
    /// LSN of the message.
    pub lsn: u64,
    /// The prefix given by the emitter.
    pub prefix: String,
    /// The content, a slice of the decoded buffer.
    pub content: Bytes,
}

/// `'b'`: start of a transaction that is being prepared for two-phase
/// commit. Sent at `PREPARE TRANSACTION` time, with protocol version 3 and
/// `two_phase` (or any protocol version on a slot created with `two_phase`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeginPrepare {
    /// LSN of the `PREPARE TRANSACTION` record (where it starts).
    pub prepare_lsn: u64,
    /// LSN just past the end of the prepared transaction.
    pub end_lsn: u64,
    /// Prepare time in microseconds since 2000-01-01 00:00 UTC.
    pub prepare_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The global transaction identifier given to `PREPARE TRANSACTION`.
    pub gid: String,
}

/// `'P'` (and `'p'`, [`Message::StreamPrepare`]): the transaction was
/// prepared. It stays undecided until [`CommitPrepared`] or
/// [`RollbackPrepared`] names it, possibly after other transactions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    /// Flags; currently unused by PostgreSQL (0).
    pub flags: u8,
    /// LSN of the `PREPARE TRANSACTION` record.
    pub prepare_lsn: u64,
    /// LSN just past the end of the prepared transaction.
    pub end_lsn: u64,
    /// Prepare time in microseconds since 2000-01-01 00:00 UTC.
    pub prepare_time: i64,
    /// Transaction id.
    pub xid: u32,
    /// The global transaction identifier.
    pub gid: String,
}

/// `'K'`: a prepared transaction was committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitPrepared {
    /// Flags; currently unused by PostgreSQL (0).
    pub flags: u8,
    /// LSN of the `COMMIT PREPARED` record.
    pub commit_lsn: u64,
    /// LSN just past the end of that record.
    pub end_lsn: u64,
    /// Commit time in microseconds since 2000-01-01 00:00 UTC.
    pub commit_time: i64,
    /// Transaction id of the prepared transaction.
    pub xid: u32,
    /// The global transaction identifier.
    pub gid: String,
}

/// `'r'`: a prepared transaction was rolled back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RollbackPrepared {
    /// Flags; currently unused by PostgreSQL (0).
    pub flags: u8,
    /// LSN just past the end of the prepared transaction.
    pub prepare_end_lsn: u64,
    /// LSN just past the end of the `ROLLBACK PREPARED` record.
    pub rollback_end_lsn: u64,
    /// Prepare time in microseconds since 2000-01-01 00:00 UTC.
    pub prepare_time: i64,
    /// Rollback time in microseconds since 2000-01-01 00:00 UTC.
    pub rollback_time: i64,
    /// Transaction id of the prepared transaction.
    pub xid: u32,
    /// The global transaction identifier.
    pub gid: String,
}
