//! What is fuzzed, and how inputs are mutated.
//!
//! A target takes bytes and must not panic: every input is either decoded
//! (and then read all the way through) or refused with an error.

use std::path::Path;

use bytes::Bytes;

/// The fuzzed parsers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// `pgoutput::decode`, then every column of every row image.
    Pgoutput,
    /// `Config::from_parts` on the input as a TOML file (and an environment override).
    Config,
}

impl Target {
    /// Directory name under `fuzz/seeds` and prefix of findings.
    pub fn name(self) -> &'static str {
        match self {
            Target::Pgoutput => "pgoutput",
            Target::Config => "config",
        }
    }

    /// Run one input. Panics are what the fuzzer looks for.
    pub fn run(self, input: &[u8]) {
        match self {
            Target::Pgoutput => pgoutput_target(input),
            Target::Config => config_target(input),
        }
    }
}

fn pgoutput_target(input: &[u8]) {
    use pgoutput::Message;
    let Ok(message) = pgoutput::decode(Bytes::copy_from_slice(input)) else {
        return;
    };
    let walk = |tuple: &pgoutput::TupleData| {
        let mut n = 0usize;
        for value in tuple.iter() {
            n += match value {
                pgoutput::Value::Text(b) | pgoutput::Value::Binary(b) => b.len(),
                _ => 1,
            };
        }
        for i in 0..tuple.len() + 2 {
            let _ = tuple.get(i);
        }
        n
    };
    let old = |old: &pgoutput::OldTuple| match old {
        pgoutput::OldTuple::Key(t) | pgoutput::OldTuple::Full(t) => walk(t),
    };
    let _ = match &message {
        Message::Insert(insert) => walk(&insert.tuple),
        Message::Update(update) => walk(&update.new) + update.old.as_ref().map_or(0, old),
        Message::Delete(delete) => old(&delete.old),
        Message::Relation(relation) => relation.columns.len(),
        _ => 0,
    };
    let _ = format!("{message:?}");
}

fn config_target(input: &[u8]) {
    let text = String::from_utf8_lossy(input);
    // The first line, if short, also becomes an environment override.
    let env = text
        .lines()
        .next()
        .filter(|l| l.len() < 200)
        .map(|l| ("OUTBOX_RELAY__POSTGRES__SLOT".to_owned(), l.to_owned()));
    match outbox_relay::Config::from_parts(&text, Path::new("fuzz.toml"), env) {
        Ok(config) => {
            // A loaded configuration is usable: these are what the relay reads first.
            let _ = config.table();
            let _ = config.postgres.tls();
            // (Not ConnInfo::new: it reads postgres.password_file, and a
            // fuzzed path could be /dev/zero.)
        }
        Err(e) => {
            let text = e.to_string();
            assert!(!text.is_empty(), "an error says something");
        }
    }
}

/// Change `input` in one to four random ways; `other` is another seed to splice from.
pub fn mutate(input: &mut Vec<u8>, other: &[u8]) {
    const INTERESTING: [u8; 8] = [0x00, 0x01, 0x7f, 0x80, 0xff, b'\n', b'"', b'='];
    for _ in 0..fastrand::usize(1..=4) {
        let len = input.len();
        match fastrand::u8(0..9) {
            0 if len > 0 => {
                let i = fastrand::usize(..len);
                input[i] ^= 1 << fastrand::u8(0..8);
            }
            1 if len > 0 => {
                let i = fastrand::usize(..len);
                input[i] = INTERESTING[fastrand::usize(..INTERESTING.len())];
            }
            2 => {
                let i = fastrand::usize(..=len);
                input.insert(i, fastrand::u8(..));
            }
            3 if len > 0 => {
                let i = fastrand::usize(..len);
                let n = fastrand::usize(1..=(len - i).min(16));
                input.drain(i..i + n);
            }
            4 if len > 0 => input.truncate(fastrand::usize(..len)),
            5 if len >= 4 => {
                // A length or count field set to something extreme.
                let i = fastrand::usize(..=len - 4);
                let value: u32 = [0, 1, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff, len as u32 + 1]
                    [fastrand::usize(..6)];
                input[i..i + 4].copy_from_slice(&value.to_be_bytes());
            }
            6 if len >= 2 => {
                let i = fastrand::usize(..=len - 2);
                let value: u16 = [0, 1, 0x7fff, 0x8000, 0xffff][fastrand::usize(..5)];
                input[i..i + 2].copy_from_slice(&value.to_be_bytes());
            }
            7 if !other.is_empty() => {
                // Splice: a piece of another seed.
                let from = fastrand::usize(..other.len());
                let n = fastrand::usize(1..=(other.len() - from).min(64));
                let at = fastrand::usize(..=len);
                input.splice(at..at, other[from..from + n].iter().copied());
            }
            8 if len > 1 => {
                // Duplicate a piece in place.
                let from = fastrand::usize(..len);
                let n = fastrand::usize(1..=(len - from).min(32));
                let piece: Vec<u8> = input[from..from + n].to_vec();
                let at = fastrand::usize(..=len);
                input.splice(at..at, piece);
            }
            _ => input.push(fastrand::u8(..)),
        }
    }
}
