//! Property tests: no input panics, encoded messages round-trip, mutated
//! messages never panic.

use bytes::Bytes;
use proptest::prelude::*;

use super::messages::samples;
use super::wire::{encode, tuple, Wire};
use crate::{
    decode, Begin, BeginPrepare, Column, Commit, CommitPrepared, Delete, Insert, LogicalMessage,
    Message, OldTuple, Origin, Prepare, Relation, RollbackPrepared, Truncate, TupleData, Type,
    Update, Value,
};

const KINDS: &[u8] = b"BCORYIUDTMbPKrp";

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn name() -> impl Strategy<Value = String> {
    "[a-z_0-9é€😀 ]{0,10}"
}

fn bytes(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::UnchangedToast),
        bytes(24).prop_map(Value::Text),
        bytes(24).prop_map(Value::Binary),
    ]
}

fn values() -> impl Strategy<Value = Vec<Value>> {
    prop::collection::vec(value(), 0..8)
}

fn tuple_data() -> impl Strategy<Value = TupleData> {
    values().prop_map(|v| tuple(&v))
}

fn old_tuple() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        tuple_data().prop_map(OldTuple::Key),
        tuple_data().prop_map(OldTuple::Full),
    ]
}

fn column() -> impl Strategy<Value = Column> {
    (any::<u8>(), name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| Column {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    )
}

/// A gid: any text PostgreSQL takes (under 200 bytes).
fn gid() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_:.é€😀 -]{0,40}"
}

fn prepare() -> impl Strategy<Value = Prepare> {
    (
        any::<u8>(),
        any::<u64>(),
        any::<u64>(),
        any::<i64>(),
        any::<u32>(),
        gid(),
    )
        .prop_map(
            |(flags, prepare_lsn, end_lsn, prepare_time, xid, gid)| Prepare {
                flags,
                prepare_lsn,
                end_lsn,
                prepare_time,
                xid,
                gid,
            },
        )
}

/// The two-phase messages (`'b'`, `'P'`, `'p'`, `'K'`, `'r'`).
fn two_phase_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            any::<u32>(),
            gid()
        )
            .prop_map(|(prepare_lsn, end_lsn, prepare_time, xid, gid)| {
                Message::BeginPrepare(BeginPrepare {
                    prepare_lsn,
                    end_lsn,
                    prepare_time,
                    xid,
                    gid,
                })
            }),
        prepare().prop_map(Message::Prepare),
        prepare().prop_map(Message::StreamPrepare),
        (
            any::<u8>(),
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            any::<u32>(),
            gid()
        )
            .prop_map(|(flags, commit_lsn, end_lsn, commit_time, xid, gid)| {
                Message::CommitPrepared(CommitPrepared {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                    xid,
                    gid,
                })
            }),
        (
            any::<u8>(),
            any::<u64>(),
            any::<u64>(),
            any::<i64>(),
            any::<i64>(),
            any::<u32>(),
            gid()
        )
            .prop_map(
                |(
                    flags,
                    prepare_end_lsn,
                    rollback_end_lsn,
                    prepare_time,
                    rollback_time,
                    xid,
                    gid,
                )| {
                    Message::RollbackPrepared(RollbackPrepared {
                        flags,
                        prepare_end_lsn,
                        rollback_end_lsn,
                        prepare_time,
                        rollback_time,
                        xid,
                        gid,
                    })
                }
            ),
    ]
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        two_phase_message(),
        (any::<u64>(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
            Message::Begin(Begin {
                final_lsn,
                commit_time,
                xid,
            })
        }),
        (any::<u8>(), any::<u64>(), any::<u64>(), any::<i64>()).prop_map(
            |(flags, commit_lsn, end_lsn, commit_time)| Message::Commit(Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_time,
            })
        ),
        (any::<u64>(), name())
            .prop_map(|(commit_lsn, name)| Message::Origin(Origin { commit_lsn, name })),
        (
            any::<u32>(),
            name(),
            name(),
            any::<u8>(),
            prop::collection::vec(column(), 0..6)
        )
            .prop_map(|(oid, namespace, name, replica_identity, columns)| {
                Message::Relation(Relation {
                    oid,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            }),
        (any::<u32>(), name(), name()).prop_map(|(oid, namespace, name)| Message::Type(Type {
            oid,
            namespace,
            name
        })),
        (any::<u32>(), tuple_data()).prop_map(|(relation_oid, tuple)| Message::Insert(Insert {
            relation_oid,
            tuple
        })),
        (any::<u32>(), prop::option::of(old_tuple()), tuple_data()).prop_map(
            |(relation_oid, old, new)| Message::Update(Update {
                relation_oid,
                old,
                new
            })
        ),
        (any::<u32>(), old_tuple())
            .prop_map(|(relation_oid, old)| Message::Delete(Delete { relation_oid, old })),
        (any::<u8>(), prop::collection::vec(any::<u32>(), 0..6)).prop_map(
            |(options, relation_oids)| Message::Truncate(Truncate {
                options,
                relation_oids
            })
        ),
        (any::<bool>(), any::<u64>(), name(), bytes(32)).prop_map(
            |(transactional, lsn, prefix, content)| Message::Message(LogicalMessage {
                transactional,
                lsn,
                prefix,
                content,
            })
        ),
    ]
}

/// One edit of an encoded message; positions are taken modulo its length.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, u8),
    Remove(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 0..8u8).prop_map(|(i, bit)| Mutation::Flip(i, bit)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Remove),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    match *mutation {
        Mutation::Flip(i, bit) if len > 0 => bytes[i % len] ^= 1 << bit,
        Mutation::Set(i, b) if len > 0 => bytes[i % len] = b,
        Mutation::Insert(i, b) => bytes.insert(i % (len + 1), b),
        Mutation::Remove(i) if len > 0 => {
            bytes.remove(i % len);
        }
        _ => {}
    }
}

/// Anything `decode` accepts must survive re-encoding unchanged, and its
/// tuples must read back as many values as they claim.
fn check_consistent(message: &Message) {
    assert_eq!(decode(Bytes::from(encode(message))).as_ref(), Ok(message));
    let tuples: Vec<&TupleData> = match message {
        Message::Insert(m) => vec![&m.tuple],
        Message::Update(m) => m.old.iter().map(OldTuple::tuple).chain([&m.new]).collect(),
        Message::Delete(m) => vec![m.old.tuple()],
        _ => vec![],
    };
    for t in tuples {
        assert_eq!(t.iter().count(), t.len());
        // One pass over the row gives what one lookup a column gives.
        let n = t.len();
        let wanted = [n.saturating_sub(1), 0, n / 2, n, 0, usize::MAX, 1];
        assert_eq!(t.get_many(wanted), wanted.map(|i| t.get(i)));
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn random_bytes_never_panic(input in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(message) = decode(Bytes::from(input)) {
            check_consistent(&message);
        }
    }

    #[test]
    fn random_bodies_of_every_type_never_panic(
        kind in prop::sample::select(KINDS),
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let input = Wire::msg(kind).raw(&body).build();
        if let Ok(message) = decode(input) {
            check_consistent(&message);
        }
    }

    #[test]
    fn encoded_messages_round_trip(message in message()) {
        let wire = encode(&message);
        prop_assert_eq!(decode(Bytes::from(wire)), Ok(message));
    }

    #[test]
    fn two_phase_messages_round_trip(message in two_phase_message()) {
        let wire = encode(&message);
        prop_assert_eq!(decode(Bytes::from(wire)), Ok(message));
    }

    #[test]
    fn mutated_two_phase_messages_never_panic(
        message in two_phase_message(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut wire = encode(&message);
        for m in &mutations {
            apply(&mut wire, m);
        }
        if let Ok(decoded) = decode(Bytes::from(wire)) {
            check_consistent(&decoded);
        }
    }

    #[test]
    fn tuple_values_round_trip(values in values(), oid in any::<u32>()) {
        let wire = Wire::msg(b'I').u32(oid).u8(b'N').values(&values).build();
        let decoded = decode(wire);
        let Ok(Message::Insert(insert)) = decoded else {
            return Err(TestCaseError::fail(format!("{decoded:?}")));
        };
        prop_assert_eq!(insert.tuple.len(), values.len());
        prop_assert_eq!(insert.tuple.is_empty(), values.is_empty());
        prop_assert_eq!(insert.tuple.iter().collect::<Vec<_>>(), values.clone());
        for (i, v) in values.iter().enumerate() {
            prop_assert_eq!(insert.tuple.get(i), Some(v.clone()));
        }
        prop_assert_eq!(insert.tuple.get(values.len()), None);
    }

    #[test]
    fn mutated_messages_never_panic(
        message in message(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut wire = encode(&message);
        for m in &mutations {
            apply(&mut wire, m);
        }
        if let Ok(decoded) = decode(Bytes::from(wire)) {
            check_consistent(&decoded);
        }
    }

    #[test]
    fn mutated_samples_never_panic(
        index in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let samples = samples();
        let mut wire = index.get(&samples).to_vec();
        for m in &mutations {
            apply(&mut wire, m);
        }
        if let Ok(decoded) = decode(Bytes::from(wire)) {
            check_consistent(&decoded);
        }
    }
}
