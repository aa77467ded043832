//! Every message type, built byte by byte, decoded field by field.

use bytes::Bytes;

use super::wire::{tuple, Wire};
use crate::{
    decode, Begin, BeginPrepare, Column, Commit, CommitPrepared, Delete, Insert, LogicalMessage,
    Message, OldTuple, Origin, Prepare, Relation, RollbackPrepared, Truncate, Type, Update, Value,
};

const LSN: u64 = 0x0000_0001_6B37_4D48;
/// 2024-05-01 12:00:00 UTC in microseconds since 2000-01-01.
const TIME: i64 = 767_793_600_000_000;

fn text(s: &'static str) -> Value {
    Value::Text(Bytes::from_static(s.as_bytes()))
}

fn begin_bytes() -> Bytes {
    Wire::msg(b'B').u64(LSN).i64(TIME).u32(771).build()
}

fn commit_bytes() -> Bytes {
    Wire::msg(b'C')
        .u8(0)
        .u64(LSN)
        .u64(LSN + 0x30)
        .i64(TIME)
        .build()
}

fn origin_bytes() -> Bytes {
    Wire::msg(b'O').u64(LSN).str("pg_16401").build()
}

fn relation_bytes() -> Bytes {
    Wire::msg(b'R')
        .u32(16386)
        .str("public")
        .str("outbox")
        .u8(b'd')
        .u16(3)
        .u8(1)
        .str("id")
        .u32(20)
        .i32(-1)
        .u8(0)
        .str("topic")
        .u32(1043)
        .i32(64 + 4)
        .u8(0)
        .str("payload")
        .u32(3802)
        .i32(-1)
        .build()
}

fn type_bytes() -> Bytes {
    Wire::msg(b'Y').u32(16390).str("public").str("mood").build()
}

fn insert_bytes() -> Bytes {
    Wire::msg(b'I')
        .u32(16386)
        .u8(b'N')
        .u16(4)
        .u8(b't')
        .i32(2)
        .raw(b"42")
        .u8(b'n')
        .u8(b'u')
        .u8(b'b')
        .i32(3)
        .raw(&[0x00, 0xff, 0x10])
        .build()
}

fn update_without_old_bytes() -> Bytes {
    Wire::msg(b'U')
        .u32(16386)
        .u8(b'N')
        .u16(2)
        .u8(b't')
        .i32(1)
        .raw(b"7")
        .u8(b'u')
        .build()
}

fn update_with_key_bytes() -> Bytes {
    Wire::msg(b'U')
        .u32(16386)
        .u8(b'K')
        .u16(2)
        .u8(b't')
        .i32(1)
        .raw(b"7")
        .u8(b'n')
        .u8(b'N')
        .u16(2)
        .u8(b't')
        .i32(1)
        .raw(b"8")
        .u8(b't')
        .i32(0)
        .build()
}

fn update_with_full_old_bytes() -> Bytes {
    Wire::msg(b'U')
        .u32(16386)
        .u8(b'O')
        .u16(1)
        .u8(b't')
        .i32(3)
        .raw(b"old")
        .u8(b'N')
        .u16(1)
        .u8(b't')
        .i32(3)
        .raw(b"new")
        .build()
}

fn delete_key_bytes() -> Bytes {
    Wire::msg(b'D')
        .u32(16386)
        .u8(b'K')
        .u16(2)
        .u8(b't')
        .i32(2)
        .raw(b"42")
        .u8(b'n')
        .build()
}

fn delete_full_bytes() -> Bytes {
    Wire::msg(b'D')
        .u32(16386)
        .u8(b'O')
        .u16(2)
        .u8(b't')
        .i32(2)
        .raw(b"42")
        .u8(b't')
        .i32(6)
        .raw(b"orders")
        .build()
}

fn truncate_bytes() -> Bytes {
    Wire::msg(b'T')
        .i32(3)
        .u8(3)
        .u32(16386)
        .u32(16392)
        .u32(16400)
        .build()
}

fn message_bytes(transactional: bool) -> Bytes {
    Wire::msg(b'M')
        .u8(u8::from(transactional))
        .u64(LSN)
        .str("outbox")
        .i32(5)
        .raw(b"hello")
        .build()
}

fn begin_prepare_bytes() -> Bytes {
    Wire::msg(b'b')
        .u64(LSN)
        .u64(LSN + 0xF8)
        .i64(TIME)
        .u32(771)
        .str("order-42")
        .build()
}

fn prepare_bytes(kind: u8) -> Bytes {
    Wire::msg(kind)
        .u8(0)
        .u64(LSN)
        .u64(LSN + 0xF8)
        .i64(TIME)
        .u32(771)
        .str("order-42")
        .build()
}

fn commit_prepared_bytes() -> Bytes {
    Wire::msg(b'K')
        .u8(0)
        .u64(LSN + 0x200)
        .u64(LSN + 0x238)
        .i64(TIME + 5)
        .u32(771)
        .str("order-42")
        .build()
}

fn rollback_prepared_bytes() -> Bytes {
    Wire::msg(b'r')
        .u8(0)
        .u64(LSN + 0xF8)
        .u64(LSN + 0x238)
        .i64(TIME)
        .i64(TIME + 5)
        .u32(771)
        .str("")
        .build()
}

/// One valid encoding of every message shape, for prefix and mutation tests.
pub(super) fn samples() -> Vec<Bytes> {
    vec![
        begin_bytes(),
        commit_bytes(),
        origin_bytes(),
        relation_bytes(),
        type_bytes(),
        insert_bytes(),
        update_without_old_bytes(),
        update_with_key_bytes(),
        update_with_full_old_bytes(),
        delete_key_bytes(),
        delete_full_bytes(),
        truncate_bytes(),
        message_bytes(true),
        message_bytes(false),
        Wire::msg(b'I').u32(1).u8(b'N').u16(0).build(),
        begin_prepare_bytes(),
        prepare_bytes(b'P'),
        prepare_bytes(b'p'),
        commit_prepared_bytes(),
        rollback_prepared_bytes(),
    ]
}

#[test]
fn begin_prepare() {
    assert_eq!(
        decode(begin_prepare_bytes()),
        Ok(Message::BeginPrepare(BeginPrepare {
            prepare_lsn: LSN,
            end_lsn: LSN + 0xF8,
            prepare_time: TIME,
            xid: 771,
            gid: "order-42".into(),
        }))
    );
}

#[test]
fn prepare_and_stream_prepare() {
    let prepared = Prepare {
        flags: 0,
        prepare_lsn: LSN,
        end_lsn: LSN + 0xF8,
        prepare_time: TIME,
        xid: 771,
        gid: "order-42".into(),
    };
    assert_eq!(
        decode(prepare_bytes(b'P')),
        Ok(Message::Prepare(prepared.clone()))
    );
    assert_eq!(
        decode(prepare_bytes(b'p')),
        Ok(Message::StreamPrepare(prepared))
    );
}

#[test]
fn commit_prepared() {
    assert_eq!(
        decode(commit_prepared_bytes()),
        Ok(Message::CommitPrepared(CommitPrepared {
            flags: 0,
            commit_lsn: LSN + 0x200,
            end_lsn: LSN + 0x238,
            commit_time: TIME + 5,
            xid: 771,
            gid: "order-42".into(),
        }))
    );
}

#[test]
fn rollback_prepared_with_an_empty_gid() {
    assert_eq!(
        decode(rollback_prepared_bytes()),
        Ok(Message::RollbackPrepared(RollbackPrepared {
            flags: 0,
            prepare_end_lsn: LSN + 0xF8,
            rollback_end_lsn: LSN + 0x238,
            prepare_time: TIME,
            rollback_time: TIME + 5,
            xid: 771,
            gid: String::new(),
        }))
    );
}

#[test]
fn a_gid_of_the_longest_length_postgres_allows() {
    // GIDSIZE is 200 bytes with the terminator; multi-byte characters count in bytes.
    let gid = "é".repeat(99) + "x";
    assert_eq!(gid.len(), 199);
    let wire = Wire::msg(b'K')
        .u8(0)
        .u64(1)
        .u64(2)
        .i64(3)
        .u32(4)
        .str(&gid)
        .build();
    let Ok(Message::CommitPrepared(commit)) = decode(wire) else {
        panic!("not a commit prepared");
    };
    assert_eq!(commit.gid, gid);
}

#[test]
fn begin() {
    assert_eq!(
        decode(begin_bytes()),
        Ok(Message::Begin(Begin {
            final_lsn: LSN,
            commit_time: TIME,
            xid: 771
        }))
    );
}

#[test]
fn commit() {
    assert_eq!(
        decode(commit_bytes()),
        Ok(Message::Commit(Commit {
            flags: 0,
            commit_lsn: LSN,
            end_lsn: LSN + 0x30,
            commit_time: TIME
        }))
    );
}

#[test]
fn origin() {
    assert_eq!(
        decode(origin_bytes()),
        Ok(Message::Origin(Origin {
            commit_lsn: LSN,
            name: "pg_16401".into()
        }))
    );
}

#[test]
fn relation() {
    let Ok(Message::Relation(rel)) = decode(relation_bytes()) else {
        panic!("not a relation");
    };
    assert_eq!(rel.oid, 16386);
    assert_eq!(rel.namespace, "public");
    assert_eq!(rel.name, "outbox");
    assert_eq!(rel.replica_identity, b'd');
    assert_eq!(
        rel.columns,
        [
            Column {
                flags: 1,
                name: "id".into(),
                type_oid: 20,
                type_modifier: -1
            },
            Column {
                flags: 0,
                name: "topic".into(),
                type_oid: 1043,
                type_modifier: 68
            },
            Column {
                flags: 0,
                name: "payload".into(),
                type_oid: 3802,
                type_modifier: -1
            },
        ]
    );
    let keys: Vec<bool> = rel.columns.iter().map(Column::is_key).collect();
    assert_eq!(keys, [true, false, false]);
}

#[test]
fn relation_in_pg_catalog_without_columns() {
    let wire = Wire::msg(b'R')
        .u32(1259)
        .str("")
        .str("pg_class")
        .u8(b'n')
        .u16(0)
        .build();
    assert_eq!(
        decode(wire),
        Ok(Message::Relation(Relation {
            oid: 1259,
            namespace: String::new(),
            name: "pg_class".into(),
            replica_identity: b'n',
            columns: vec![],
        }))
    );
}

#[test]
fn type_() {
    assert_eq!(
        decode(type_bytes()),
        Ok(Message::Type(Type {
            oid: 16390,
            namespace: "public".into(),
            name: "mood".into()
        }))
    );
}

#[test]
fn insert_with_every_value_kind() {
    let wire = insert_bytes();
    let Ok(Message::Insert(insert)) = decode(wire.clone()) else {
        panic!("not an insert");
    };
    assert_eq!(insert.relation_oid, 16386);
    let row = &insert.tuple;
    assert_eq!(row.len(), 4);
    assert!(!row.is_empty());
    let values: Vec<Value> = row.iter().collect();
    assert_eq!(
        values,
        [
            text("42"),
            Value::Null,
            Value::UnchangedToast,
            Value::Binary(Bytes::from_static(&[0x00, 0xff, 0x10])),
        ]
    );
    assert_eq!(row.get(0), Some(text("42")));
    assert_eq!(row.get(2), Some(Value::UnchangedToast));
    assert_eq!(row.get(4), None);
    assert_eq!(row.get(usize::MAX), None);
    assert_eq!(
        row.get_many([2, 0, 4, 3, 0]),
        [
            Some(Value::UnchangedToast),
            Some(text("42")),
            None,
            Some(values[3].clone()),
            Some(text("42")),
        ]
    );
    assert_eq!(insert.tuple, tuple(&values));

    // Zero-copy: the value points into the input buffer.
    let Some(Value::Text(v)) = row.get(0) else {
        panic!("not text");
    };
    let input = wire.as_ptr_range();
    assert!(input.contains(&v.as_ptr()));
}

#[test]
fn insert_of_empty_tuple() {
    let Ok(Message::Insert(insert)) = decode(Wire::msg(b'I').u32(9).u8(b'N').u16(0).build()) else {
        panic!("not an insert");
    };
    assert!(insert.tuple.is_empty());
    assert_eq!(insert.tuple.len(), 0);
    assert_eq!(insert.tuple.iter().count(), 0);
    assert_eq!(insert.tuple.get(0), None);
}

#[test]
fn update_without_old_tuple() {
    assert_eq!(
        decode(update_without_old_bytes()),
        Ok(Message::Update(Update {
            relation_oid: 16386,
            old: None,
            new: tuple(&[text("7"), Value::UnchangedToast]),
        }))
    );
}

#[test]
fn update_with_old_key() {
    assert_eq!(
        decode(update_with_key_bytes()),
        Ok(Message::Update(Update {
            relation_oid: 16386,
            old: Some(OldTuple::Key(tuple(&[text("7"), Value::Null]))),
            new: tuple(&[text("8"), text("")]),
        }))
    );
}

#[test]
fn update_with_full_old_row() {
    let Ok(Message::Update(update)) = decode(update_with_full_old_bytes()) else {
        panic!("not an update");
    };
    let Some(OldTuple::Full(old)) = &update.old else {
        panic!("no full old row");
    };
    assert_eq!(old.get(0), Some(text("old")));
    assert_eq!(update.old.as_ref().map(OldTuple::tuple), Some(old));
    assert_eq!(update.new.get(0), Some(text("new")));
}

#[test]
fn delete_by_key() {
    assert_eq!(
        decode(delete_key_bytes()),
        Ok(Message::Delete(Delete {
            relation_oid: 16386,
            old: OldTuple::Key(tuple(&[text("42"), Value::Null])),
        }))
    );
}

#[test]
fn delete_full_row() {
    assert_eq!(
        decode(delete_full_bytes()),
        Ok(Message::Delete(Delete {
            relation_oid: 16386,
            old: OldTuple::Full(tuple(&[text("42"), text("orders")])),
        }))
    );
}

#[test]
fn truncate_several_relations() {
    let Ok(Message::Truncate(truncate)) = decode(truncate_bytes()) else {
        panic!("not a truncate");
    };
    assert_eq!(truncate.relation_oids, [16386, 16392, 16400]);
    assert!(truncate.cascade());
    assert!(truncate.restart_identity());

    let plain = Truncate {
        options: 0,
        relation_oids: vec![1],
    };
    assert!(!plain.cascade() && !plain.restart_identity());
    assert_eq!(
        decode(Wire::msg(b'T').i32(1).u8(0).u32(1).build()),
        Ok(Message::Truncate(plain))
    );
}

#[test]
fn truncate_options_are_independent() {
    let cascade_only = Truncate {
        options: 1,
        relation_oids: vec![],
    };
    assert!(cascade_only.cascade() && !cascade_only.restart_identity());
    let restart_only = Truncate {
        options: 2,
        relation_oids: vec![],
    };
    assert!(!restart_only.cascade() && restart_only.restart_identity());
}

#[test]
fn transactional_message() {
    let wire = message_bytes(true);
    let Ok(Message::Message(msg)) = decode(wire.clone()) else {
        panic!("not a logical message");
    };
    assert_eq!(
        msg,
        LogicalMessage {
            transactional: true,
            lsn: LSN,
            prefix: "outbox".into(),
            content: Bytes::from_static(b"hello"),
        }
    );
    assert!(wire.as_ptr_range().contains(&msg.content.as_ptr()));
}

#[test]
fn non_transactional_message() {
    let Ok(Message::Message(msg)) = decode(message_bytes(false)) else {
        panic!("not a logical message");
    };
    assert!(!msg.transactional);
    assert_eq!(msg.prefix, "outbox");
    assert_eq!(&msg.content[..], b"hello");
}

#[test]
fn message_with_empty_content() {
    let wire = Wire::msg(b'M').u8(0).u64(1).str("p").i32(0).build();
    let Ok(Message::Message(msg)) = decode(wire) else {
        panic!("not a logical message");
    };
    assert!(msg.content.is_empty());
}

#[test]
fn insert_struct_shape() {
    // The lead's code matches on these exact shapes.
    let insert = Insert {
        relation_oid: 1,
        tuple: tuple(&[Value::Null]),
    };
    assert_eq!(
        decode(Wire::msg(b'I').u32(1).u8(b'N').u16(1).u8(b'n').build()),
        Ok(Message::Insert(insert))
    );
}
