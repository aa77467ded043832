//! Row images: [`TupleData`] and its column [`Value`]s.

use std::ops::Range;

use bytes::Bytes;

use crate::reader::{Reader, NEGATIVE_LENGTH};
use crate::DecodeError;

const KIND_NULL: u8 = b'n';
const KIND_UNCHANGED_TOAST: u8 = b'u';
const KIND_TEXT: u8 = b't';
const KIND_BINARY: u8 = b'b';

/// One column of a row image.
///
/// `Text` and `Binary` hold slices of the buffer given to
/// [`decode`](crate::decode); no bytes are copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// SQL NULL (`'n'`).
    Null,
    /// A TOASTed value that did not change and was not sent (`'u'`).
    UnchangedToast,
    /// The value in the type's text output format (`'t'`).
    Text(Bytes),
    /// The value in the type's binary send format (`'b'`).
    Binary(Bytes),
}

/// One column of a row image, borrowed from the row: a [`Value`] without
/// the reference count (see [`TupleData::get_many_ref`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueRef<'a> {
    /// SQL NULL (`'n'`).
    Null,
    /// A TOASTed value that did not change and was not sent (`'u'`).
    UnchangedToast,
    /// The value in the type's text output format (`'t'`).
    Text(&'a [u8]),
    /// The value in the type's binary send format (`'b'`).
    Binary(&'a [u8]),
}

/// A row image of an [`Insert`](crate::Insert), [`Update`](crate::Update)
/// or [`Delete`](crate::Delete).
///
/// [`decode`](crate::decode) has already checked every column's kind byte
/// and length, so the raw bytes are kept as they came and reading them is
/// infallible and allocation-free. Two tuples are equal when they hold the
/// same values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TupleData {
    /// Number of columns.
    count: u16,
    /// The encoded columns (everything after the `Int16` count), a slice of
    /// the decoded message.
    columns: Bytes,
}

impl TupleData {
    /// Number of columns in the row image.
    pub fn len(&self) -> usize {
        usize::from(self.count)
    }

    /// Whether the row image has no columns.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The column values in order.
    pub fn iter(&self) -> impl Iterator<Item = Value> + '_ {
        let mut reader = Reader::new(&self.columns, 0, "TupleData");
        (0..self.count).map_while(move |_| {
            let span = read_column(&mut reader).ok()?;
            Some(self.to_value(span.borrow(&self.columns)))
        })
    }

    /// The value of column `index` (0-based), or `None` past the last column.
    /// Steps over the columns before it without making values of them (a
    /// value holds a reference-counted slice: making and dropping one for
    /// every earlier column made a row's fields quadratic in atomic counts).
    pub fn get(&self, index: usize) -> Option<Value> {
        if index >= self.len() {
            return None;
        }
        let mut reader = Reader::new(&self.columns, 0, "TupleData");
        for _ in 0..index {
            read_column(&mut reader).ok()?;
        }
        let span = read_column(&mut reader).ok()?;
        Some(self.to_value(span.borrow(&self.columns)))
    }

    /// The values of the columns at `indices`, each `None` past the last
    /// column, read in one pass over the row. For several fields of one row
    /// this is cheaper than [`get`](Self::get) for each, which starts from
    /// the first column every time.
    pub fn get_many<const N: usize>(&self, indices: [usize; N]) -> [Option<Value>; N] {
        self.get_many_ref(indices)
            .map(|value| value.map(|v| self.to_value(v)))
    }

    /// [`get_many`](Self::get_many), each value borrowed from the row. A
    /// [`Value`] holds a reference-counted slice, and counting costs an
    /// atomic operation a value, made and again dropped; a caller that copies
    /// what it reads, or keeps one value of the row, pays only for what it
    /// keeps ([`share`](Self::share)).
    pub fn get_many_ref<const N: usize>(&self, indices: [usize; N]) -> [Option<ValueRef<'_>>; N] {
        let mut values = [None; N];
        let Some(last) = indices.iter().copied().filter(|&i| i < self.len()).max() else {
            return values;
        };
        let mut reader = Reader::new(&self.columns, 0, "TupleData");
        for column in 0..=last {
            let Ok(span) = read_column(&mut reader) else {
                break;
            };
            for (value, &wanted) in values.iter_mut().zip(&indices) {
                if wanted == column {
                    *value = Some(span.borrow(&self.columns));
                }
            }
        }
        values
    }

    /// `slice`, which a [`ValueRef`] of this row holds, as `Bytes` sharing
    /// the row's buffer (no copy).
    ///
    /// # Panics
    ///
    /// When `slice` is not within this row's bytes.
    pub fn share(&self, slice: &[u8]) -> Bytes {
        self.columns.slice_ref(slice)
    }

    /// A borrowed value of this row as an owned one.
    fn to_value(&self, value: ValueRef<'_>) -> Value {
        match value {
            ValueRef::Null => Value::Null,
            ValueRef::UnchangedToast => Value::UnchangedToast,
            ValueRef::Text(s) => Value::Text(self.share(s)),
            ValueRef::Binary(s) => Value::Binary(self.share(s)),
        }
    }

    /// Reads and validates a complete `TupleData` (count and columns) at the
    /// reader's position; `buf` is the buffer the reader reads.
    pub(crate) fn read(buf: &Bytes, reader: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let count = reader.u16()?;
        let start = reader.pos();
        for _ in 0..count {
            read_column(reader)?;
        }
        Ok(Self {
            count,
            columns: buf.slice(start..reader.pos()),
        })
    }

    /// Builds a tuple from already-encoded columns (test encoder only).
    #[cfg(test)]
    pub(crate) fn from_raw(count: u16, columns: Bytes) -> Self {
        Self { count, columns }
    }

    /// The encoded columns after the count (test encoder only).
    #[cfg(test)]
    pub(crate) fn raw_columns(&self) -> &Bytes {
        &self.columns
    }
}

/// Where one column's value lies, before it is turned into a [`Value`].
#[derive(Clone)]
enum ColumnSpan {
    Null,
    UnchangedToast,
    Text(Range<usize>),
    Binary(Range<usize>),
}

impl ColumnSpan {
    fn borrow<'a>(&self, buf: &'a [u8]) -> ValueRef<'a> {
        match self {
            Self::Null => ValueRef::Null,
            Self::UnchangedToast => ValueRef::UnchangedToast,
            Self::Text(range) => ValueRef::Text(&buf[range.clone()]),
            Self::Binary(range) => ValueRef::Binary(&buf[range.clone()]),
        }
    }
}

/// Reads one column: its kind byte and, for text and binary values, the
/// `Int32` length and the bytes it covers.
fn read_column(reader: &mut Reader<'_>) -> Result<ColumnSpan, DecodeError> {
    let offset = reader.pos();
    match reader.u8()? {
        KIND_NULL => Ok(ColumnSpan::Null),
        KIND_UNCHANGED_TOAST => Ok(ColumnSpan::UnchangedToast),
        KIND_TEXT => {
            let len = reader.non_negative_i32(NEGATIVE_LENGTH)?;
            reader.range(len).map(ColumnSpan::Text)
        }
        KIND_BINARY => {
            let len = reader.non_negative_i32(NEGATIVE_LENGTH)?;
            reader.range(len).map(ColumnSpan::Binary)
        }
        _ => Err(reader.invalid(offset, "unknown tuple column kind")),
    }
}
