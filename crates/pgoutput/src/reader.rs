//! A bounds-checked big-endian cursor that turns every short read into a
//! [`DecodeError`] naming the message being decoded.

use std::ops::Range;

use crate::DecodeError;

/// Reasons reported in [`DecodeError::Invalid`] by the reader itself.
pub(crate) const NOT_NUL_TERMINATED: &str = "string not NUL-terminated";
pub(crate) const NOT_UTF8: &str = "string is not UTF-8";
pub(crate) const TRAILING_BYTES: &str = "trailing bytes";
pub(crate) const NEGATIVE_LENGTH: &str = "negative length";
pub(crate) const NEGATIVE_COUNT: &str = "negative count";

/// Cursor over one message buffer. Never panics: every read is checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    /// Starts reading `buf` at `pos`; errors will name `message`.
    pub(crate) fn new(buf: &'a [u8], pos: usize, message: &'static str) -> Self {
        Self { buf, pos, message }
    }

    /// Current offset from the start of the buffer.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes not yet read.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// An [`DecodeError::Invalid`] for the field at `offset`.
    pub(crate) fn invalid(&self, offset: usize, reason: &'static str) -> DecodeError {
        DecodeError::Invalid {
            message: self.message,
            offset,
            reason,
        }
    }

    fn truncated(&self, wanted: usize) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            offset: self.pos,
            needed: wanted.saturating_sub(self.remaining()),
        }
    }

    /// Fails with [`DecodeError::Truncated`] unless `n` more bytes are left.
    pub(crate) fn ensure(&self, n: usize) -> Result<(), DecodeError> {
        if n > self.remaining() {
            Err(self.truncated(n))
        } else {
            Ok(())
        }
    }

    /// Skips `n` bytes and returns their range in the buffer.
    pub(crate) fn range(&mut self, n: usize) -> Result<Range<usize>, DecodeError> {
        self.ensure(n)?;
        let start = self.pos;
        self.pos = start.saturating_add(n);
        Ok(start..self.pos)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        match rest.first_chunk::<N>() {
            Some(chunk) => {
                self.pos = self.pos.saturating_add(N);
                Ok(*chunk)
            }
            None => Err(self.truncated(N)),
        }
    }

    /// Reads a `Byte1`/`Int8`.
    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        self.array::<1>().map(|[b]| b)
    }

    /// Reads an `Int16` as unsigned, as PostgreSQL reads counts.
    pub(crate) fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array().map(u16::from_be_bytes)
    }

    /// Reads an `Int32` as unsigned (OIDs, xids).
    pub(crate) fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_be_bytes)
    }

    /// Reads an `Int32` as signed.
    pub(crate) fn i32(&mut self) -> Result<i32, DecodeError> {
        self.array().map(i32::from_be_bytes)
    }

    /// Reads an `Int64` as unsigned (LSNs).
    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_be_bytes)
    }

    /// Reads an `Int64` as signed (timestamps).
    pub(crate) fn i64(&mut self) -> Result<i64, DecodeError> {
        self.array().map(i64::from_be_bytes)
    }

    /// Reads a signed `Int32` that must be a non-negative length or count;
    /// a negative value is reported as `reason`.
    pub(crate) fn non_negative_i32(&mut self, reason: &'static str) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let n = self.i32()?;
        usize::try_from(n).map_err(|_| self.invalid(offset, reason))
    }

    /// Reads a NUL-terminated UTF-8 string.
    pub(crate) fn string(&mut self) -> Result<String, DecodeError> {
        let start = self.pos;
        let rest = self.buf.get(start..).unwrap_or_default();
        let Some(len) = rest.iter().position(|&b| b == 0) else {
            return Err(self.invalid(start, NOT_NUL_TERMINATED));
        };
        let text = rest.get(..len).unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|_| self.invalid(start, NOT_UTF8))?;
        self.pos = start.saturating_add(len).saturating_add(1);
        Ok(text.to_owned())
    }

    /// Succeeds only if the whole buffer has been consumed.
    pub(crate) fn finish(self) -> Result<(), DecodeError> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(self.invalid(self.pos, TRAILING_BYTES))
        }
    }
}
