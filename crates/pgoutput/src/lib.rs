//! Zero-copy decoder for PostgreSQL's `pgoutput` logical replication
//! protocol: **protocol version 1**, and the two-phase messages of version 3
//! (`two_phase 'on'`, PostgreSQL 15+).
//!
//! # The format
//!
//! While a logical replication slot using the `pgoutput` plugin is streamed,
//! every `XLogData` CopyData message from the walsender carries exactly one
//! pgoutput message. Its first byte names the kind, the rest is a fixed
//! sequence of fields:
//!
//! | byte  | message                                   |
//! |-------|-------------------------------------------|
//! | `'B'` | [`Begin`] of a transaction                |
//! | `'C'` | [`Commit`] of a transaction               |
//! | `'O'` | [`Origin`] of a replicated transaction    |
//! | `'R'` | [`Relation`] (table schema) description   |
//! | `'Y'` | [`Type`] description                      |
//! | `'I'` | [`Insert`]                                |
//! | `'U'` | [`Update`]                                |
//! | `'D'` | [`Delete`]                                |
//! | `'T'` | [`Truncate`]                              |
//! | `'M'` | [`LogicalMessage`] (`pg_logical_emit_message`) |
//! | `'b'` | [`BeginPrepare`] of a transaction being prepared |
//! | `'P'` | [`Prepare`]: it was prepared (`PREPARE TRANSACTION`) |
//! | `'K'` | [`CommitPrepared`] (`COMMIT PREPARED`)    |
//! | `'r'` | [`RollbackPrepared`] (`ROLLBACK PREPARED`) |
//! | `'p'` | Stream Prepare ([`Message::StreamPrepare`], a [`Prepare`]) |
//!
//! Integers are big-endian, strings are NUL-terminated UTF-8. Row images
//! ([`TupleData`]) are an `Int16` column count followed by, per column, a
//! kind byte: `'n'` (NULL), `'u'` (unchanged TOASTed value, not sent),
//! `'t'` (text format) or `'b'` (binary format); the last two are followed by
//! an `Int32` length and that many bytes.
//!
//! # Two-phase transactions
//!
//! On a slot created with `two_phase` (and from PostgreSQL 15 on), a
//! prepared transaction is sent when it is *prepared*: `'b'`, its changes,
//! `'P'`; whether it commits comes later, in a `'K'` or `'r'` message of its
//! own that may follow other transactions. The gid and the xid name it in
//! all four. The walsender sends these on such a slot whether or not the
//! client asked for `two_phase`, whatever the `proto_version`.
//!
//! Without `streaming` (which needs protocol version 2 and an option the
//! client must ask for), the other messages of protocol versions 2 and 3 are
//! byte for byte those of version 1. Streaming's messages (`'S'`, `'E'`,
//! `'c'`, `'A'`) are reported as [`DecodeError::UnknownMessage`]: in a
//! streamed transaction the row messages carry an xid that this decoder
//! does not read. Stream Prepare (`'p'`) has the fields of `'P'` and is
//! decoded.
//!
//! # Validation and zero-copy contract
//!
//! [`decode`] validates a message completely before returning it: every
//! field is bounds-checked, every string is checked for its terminator and
//! for UTF-8, every tuple column's kind byte and length are checked against
//! the buffer, and bytes left over after a complete message are an error.
//! Decoding never panics and never allocates based on an unchecked count
//! from the wire.
//!
//! Column values and logical message contents are never copied: they are
//! [`Bytes::slice`]s of the buffer handed to [`decode`], so they share its
//! allocation. Because a [`TupleData`] has already been validated, reading
//! it afterwards ([`TupleData::iter`], [`TupleData::get`]) is infallible
//! and allocates nothing.
//!
//! ```
//! use pgoutput::{decode, Bytes, Message, Value};
//!
//! // Insert into relation 16386 of one text column "hi".
//! let wire = Bytes::from_static(b"I\x00\x00\x40\x02N\x00\x01t\x00\x00\x00\x02hi");
//! let Message::Insert(insert) = decode(wire)? else { unreachable!() };
//! assert_eq!(insert.relation_oid, 16386);
//! assert_eq!(insert.tuple.get(0), Some(Value::Text(Bytes::from_static(b"hi"))));
//! # Ok::<(), pgoutput::DecodeError>(())
//! ```

#![warn(missing_docs)]

mod decode;
mod error;
mod message;
mod reader;
mod tuple;

#[cfg(test)]
mod tests;

pub use bytes::Bytes;

pub use decode::decode;
pub use error::DecodeError;
pub use message::{
    Begin, BeginPrepare, Column, Commit, CommitPrepared, Delete, Insert, LogicalMessage, Message,
    OldTuple, Origin, Prepare, Relation, RollbackPrepared, Truncate, Type, Update,
};
pub use tuple::{TupleData, Value, ValueRef};
