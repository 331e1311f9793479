//! Apache Arrow IPC files, read in place: where a list-of-integers column (a Hugging
//! Face `datasets` `input_ids`, say) keeps each record batch's offsets and values.
//!
//! Hugging Face `datasets` writes its tables (`save_to_disk`, and its cache) in the
//! Arrow IPC *stream* format; `pyarrow.ipc.new_file` writes the *file* format, the same
//! messages between `ARROW1` magics and a footer. Both are read here message by message:
//! each one's flatbuffer metadata is parsed with bounds checks, never trusted.

/// One record batch's part of the column: `rows` lists whose `rows + 1` offsets (`i32`,
/// or `i64` for a large list) are at byte `offsets` of the file, into the values at byte
/// `values` (`values_len` bytes: the values the node counts, not the padding after). A
/// fixed-size list (`fixed`, Hugging Face's `Sequence(..., length=n)`) has no offsets:
/// row `j` is values `j * n..(j + 1) * n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Chunk {
    pub(super) rows: u64,
    pub(super) offsets: usize,
    pub(super) large: bool,
    pub(super) fixed: Option<u64>,
    pub(super) values: usize,
    pub(super) values_len: usize,
}

impl Chunk {
    /// The offsets' type: `int64` for a large list, else `int32`.
    pub(super) fn offset_type(&self) -> super::DType {
        match self.large {
            true => super::DType::I64,
            false => super::DType::I32,
        }
    }
}

/// A list-of-integers column of an Arrow IPC file: its values' type and its chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ListColumn {
    pub(super) dtype: super::DType,
    pub(super) chunks: Vec<Chunk>,
}

/// The file format's leading magic (padded to 8 bytes).
const FILE_MAGIC: &[u8; 6] = b"ARROW1";
/// A message's metadata length follows this marker (since Arrow 0.15).
const CONTINUATION: u32 = 0xFFFF_FFFF;

/// A flatbuffer table: its position in `buf`.
#[derive(Clone, Copy)]
struct Table<'a> {
    buf: &'a [u8],
    at: usize,
}

fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        buf.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

pub(super) fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        buf.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn i64_at(buf: &[u8], at: usize) -> Option<i64> {
    Some(i64::from_le_bytes(
        buf.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

impl<'a> Table<'a> {
    /// The root table of the flatbuffer `buf`.
    fn root(buf: &'a [u8]) -> Option<Table<'a>> {
        let at = u32_at(buf, 0)? as usize;
        Table::at(buf, at)
    }

    fn at(buf: &'a [u8], at: usize) -> Option<Table<'a>> {
        // The table starts with the signed distance back to its vtable.
        let vtable = (at as i64).checked_sub(i64::from(u32_at(buf, at)? as i32))?;
        let vtable = usize::try_from(vtable).ok()?;
        u16_at(buf, vtable)?;
        Some(Table { buf, at })
    }

    /// Where field `slot`'s value is, if the table has it.
    fn field(self, slot: usize) -> Option<usize> {
        let vtable = (self.at as i64 - i64::from(u32_at(self.buf, self.at)? as i32)) as usize;
        let len = u16_at(self.buf, vtable)? as usize;
        let entry = 4 + 2 * slot;
        if entry + 2 > len {
            return None;
        }
        match u16_at(self.buf, vtable + entry)? {
            0 => None,
            off => self.at.checked_add(off as usize),
        }
    }

    fn u8(self, slot: usize) -> Option<u8> {
        self.field(slot)
            .map_or(Some(0), |at| self.buf.get(at).copied())
    }

    fn i16(self, slot: usize) -> Option<i16> {
        self.field(slot)
            .map_or(Some(0), |at| u16_at(self.buf, at).map(|v| v as i16))
    }

    fn i32(self, slot: usize) -> Option<i32> {
        self.field(slot)
            .map_or(Some(0), |at| u32_at(self.buf, at).map(|v| v as i32))
    }

    fn i64(self, slot: usize) -> Option<i64> {
        self.field(slot).map_or(Some(0), |at| i64_at(self.buf, at))
    }

    fn bool(self, slot: usize) -> Option<bool> {
        self.u8(slot).map(|b| b != 0)
    }

    /// Where the object that field `slot` refers to starts (`None` if absent or out of
    /// bounds).
    fn target(self, slot: usize) -> Option<usize> {
        let at = self.field(slot)?;
        at.checked_add(u32_at(self.buf, at)? as usize)
    }

    fn table(self, slot: usize) -> Option<Table<'a>> {
        Table::at(self.buf, self.target(slot)?)
    }

    /// The vector at field `slot`: its length and where its elements start; an absent
    /// vector is empty.
    fn vector(self, slot: usize) -> Option<(usize, usize)> {
        match self.field(slot) {
            None => Some((0, 0)),
            Some(_) => {
                let at = self.target(slot)?;
                let len = u32_at(self.buf, at)? as usize;
                let first = at.checked_add(4)?;
                // Each element takes at least a byte: a length past the buffer is corrupt.
                (first.checked_add(len)? <= self.buf.len()).then_some((len, first))
            }
        }
    }

    /// The tables of the vector at field `slot`.
    fn tables(self, slot: usize) -> Option<Vec<Table<'a>>> {
        let (len, first) = self.vector(slot)?;
        (0..len)
            .map(|k| {
                let at = first.checked_add(4 * k)?;
                Table::at(self.buf, at.checked_add(u32_at(self.buf, at)? as usize)?)
            })
            .collect()
    }

    fn string(self, slot: usize) -> Option<&'a [u8]> {
        let at = self.target(slot)?;
        let len = u32_at(self.buf, at)? as usize;
        self.buf
            .get(at.checked_add(4)?..at.checked_add(4)?.checked_add(len)?)
    }
}

/// Type tags of Arrow's `Type` union (Schema.fbs).
mod ty {
    pub const NULL: u8 = 1;
    pub const INT: u8 = 2;
    pub const BINARY: u8 = 4;
    pub const UTF8: u8 = 5;
    pub const LIST: u8 = 12;
    pub const STRUCT: u8 = 13;
    pub const UNION: u8 = 14;
    pub const FIXED_SIZE_LIST: u8 = 16;
    pub const MAP: u8 = 17;
    pub const LARGE_BINARY: u8 = 19;
    pub const LARGE_UTF8: u8 = 20;
    pub const LARGE_LIST: u8 = 21;
    pub const RUN_END_ENCODED: u8 = 22;
    pub const BINARY_VIEW: u8 = 23;
    pub const UTF8_VIEW: u8 = 24;
    pub const LIST_VIEW: u8 = 25;
    pub const LARGE_LIST_VIEW: u8 = 26;
    /// Tags past the last this reader knows.
    pub const LAST: u8 = 26;
}

/// How many nodes and buffers a field takes in a record batch, in the order the fields
/// come: a field, then its children (depth first).
#[derive(Debug, Clone, Copy, Default)]
struct Place {
    node: usize,
    buffer: usize,
    /// View-typed fields seen, which take `variadicBufferCounts` in order.
    views: usize,
    /// Metadata version V4, whose unions have a validity buffer too.
    v4: bool,
}

/// What the schema says of the column asked for.
#[derive(Debug, Clone, Copy)]
struct Wanted {
    /// The list's node and first buffer (validity, then offsets); the values' node and
    /// first buffer (validity, then data) follow at `+ 1`, `+ 2`.
    at: Place,
    large: bool,
    /// A fixed-size list's size.
    fixed: Option<u64>,
    dtype: super::DType,
    /// View-typed fields before the column, whose variadic buffer counts the record
    /// batches give.
    views_before: usize,
}

/// Nested types deeper than this are refused (as flatbuffer verifiers do): the walk
/// below recurses once a level.
const MAX_DEPTH: usize = 64;

/// Counts the nodes and buffers of `field` (and its children, below `depth` levels of
/// nesting) into `place`, a view-typed field's as 2 (its variadic buffers are counted
/// per record batch). `None` for a malformed field, an unknown type or deep nesting.
///
/// Each field of a schema is a table of its own, at least 4 bytes of the metadata, so
/// more fields than a quarter of its bytes are malformed: tables listed as children
/// more than once (a flatbuffer allows it) would otherwise make a walk of 2^64 fields
/// of a 2 KB schema.
fn skip(field: Table<'_>, place: &mut Place, depth: usize) -> Option<()> {
    if depth > MAX_DEPTH || place.node >= field.buf.len() / 4 {
        return None;
    }
    place.node += 1;
    if field.field(4).is_some() {
        // Dictionary-encoded: the batch holds the indices; the values are elsewhere.
        place.buffer += 2;
        return Some(());
    }
    let tag = field.u8(2)?;
    if tag == 0 || tag > ty::LAST {
        return None;
    }
    place.buffer += match tag {
        ty::NULL => 0,
        ty::BINARY | ty::UTF8 | ty::LARGE_BINARY | ty::LARGE_UTF8 => 3,
        ty::LIST | ty::LARGE_LIST | ty::MAP => 2,
        ty::LIST_VIEW | ty::LARGE_LIST_VIEW => 3,
        ty::STRUCT | ty::FIXED_SIZE_LIST => 1,
        ty::UNION => {
            let legacy = usize::from(place.v4);
            match field.table(3)?.i16(0)? {
                0 => 1 + legacy, // sparse: type ids
                _ => 2 + legacy, // dense: type ids and offsets
            }
        }
        ty::RUN_END_ENCODED => 0,
        ty::BINARY_VIEW | ty::UTF8_VIEW => {
            place.views += 1;
            2
        }
        _ => 2,
    };
    for child in field.tables(5)? {
        skip(child, place, depth + 1)?;
    }
    Some(())
}

/// Reads the column `name` of the Arrow IPC stream or file `file` (all its bytes).
///
/// # Errors
/// A message naming what is wrong: not Arrow IPC, malformed metadata, no such column
/// (with the columns there are), a column that is not a list of integers, nulls in it,
/// compressed record batches, or buffers outside the file.
pub(super) fn list_column(file: &[u8], name: &str) -> Result<ListColumn, String> {
    let mut pos = match file.starts_with(FILE_MAGIC) {
        true => 8,
        false => 0,
    };
    // The file format ends with its footer, its length and the magic: the messages stop
    // where the footer starts, end-of-stream marker or not.
    let footer = (pos == 8 && file.ends_with(FILE_MAGIC))
        .then(|| {
            let len = u32_at(file, file.len().checked_sub(10)?)? as usize;
            file.len().checked_sub(10)?.checked_sub(len)
        })
        .flatten();
    let file = &file[..footer.unwrap_or(file.len()).max(pos).min(file.len())];
    let mut wanted: Option<Wanted> = None;
    let mut chunks = Vec::new();
    let mut message = 0usize;
    // [continuation] length, metadata, body; a 0 length (or the end) ends the stream.
    while let Some(mut len) = u32_at(file, pos) {
        let mut meta = pos + 4;
        if len == CONTINUATION {
            len = u32_at(file, meta).ok_or("cut short after a continuation marker")?;
            meta += 4;
        }
        if len == 0 {
            break;
        }
        let bad = |what: &str| match message {
            0 => format!("not an Arrow IPC stream or file (its first message: {what})"),
            _ => format!("message {message} at byte {pos}: {what}"),
        };
        let end = meta
            .checked_add(len as usize)
            .filter(|&e| e <= file.len())
            .ok_or_else(|| {
                bad(&format!(
                    "its {len} bytes of metadata pass the end of the file"
                ))
            })?;
        let buf = &file[meta..end];
        let malformed = || bad("malformed metadata (not an Arrow IPC message)");
        let m = Table::root(buf).ok_or_else(malformed)?;
        // MetadataVersion: V4 (Arrow 0.15, 2019) is 3, V5 (1.0) is 4.
        let version = m.i16(0).ok_or_else(malformed)?;
        if !(3..=4).contains(&version) {
            return Err(bad(&format!(
                "metadata version V{}: stokehold reads V4 and V5 (Arrow 0.15 and later)",
                version + 1
            )));
        }
        let body_len = m.i64(3).ok_or_else(malformed)?;
        let body_len = usize::try_from(body_len).map_err(|_| malformed())?;
        let body = end;
        let next = body
            .checked_add(body_len)
            .filter(|&e| e <= file.len())
            .ok_or_else(|| {
                bad(&format!(
                    "its {body_len}-byte body passes the end of the file"
                ))
            })?;
        match m.u8(1).ok_or_else(malformed)? {
            // Schema
            1 => {
                let schema = m.table(2).ok_or_else(malformed)?;
                if schema.i16(0).ok_or_else(malformed)? != 0 {
                    return Err(bad(
                        "a big-endian table: stokehold reads little-endian ones",
                    ));
                }
                if wanted.is_some() {
                    // The batches read so far were placed by the first one.
                    return Err(bad("a second schema: a stream has one, first"));
                }
                let fields = schema.tables(1).ok_or_else(malformed)?;
                wanted = Some(find(&fields, name, version == 3)?);
            }
            // RecordBatch
            3 => {
                let Some(w) = wanted else {
                    return Err(bad("a record batch before the schema"));
                };
                let batch = m.table(2).ok_or_else(malformed)?;
                let chunk = read_batch(batch, w, body, body_len).map_err(|e| bad(&e))?;
                chunks.push(chunk);
            }
            // Dictionary batches and anything else: not the column's.
            _ => {}
        }
        pos = next;
        message += 1;
    }
    let Some(w) = wanted else {
        return Err(match message {
            0 => "not an Arrow IPC stream or file: no message in it".into(),
            _ => "no schema message in it".into(),
        });
    };
    Ok(ListColumn {
        dtype: w.dtype,
        chunks,
    })
}

/// Finds the top-level field `name` in `fields` (of a V4 schema if `v4`), which must be
/// a list of integers.
fn find(fields: &[Table<'_>], name: &str, v4: bool) -> Result<Wanted, String> {
    let malformed = || "malformed schema".to_string();
    let mut place = Place {
        v4,
        ..Place::default()
    };
    let mut names = Vec::new();
    for &f in fields {
        let this = f.string(0).unwrap_or_default();
        if this == name.as_bytes() {
            let tag = f.u8(2).ok_or_else(malformed)?;
            let (large, fixed) = match tag {
                ty::LIST => (false, None),
                ty::LARGE_LIST => (true, None),
                ty::FIXED_SIZE_LIST => {
                    // FixedSizeList { listSize: int }, in the field's type table.
                    let size = f.table(3).and_then(|t| t.i32(0)).ok_or_else(malformed)?;
                    let size = u64::try_from(size).map_err(|_| {
                        format!("column {name:?} is a list of a negative size, {size}")
                    })?;
                    (false, Some(size))
                }
                _ => return Err(format!("column {name:?} is not a list of integers")),
            };
            let children = f.tables(5).ok_or_else(malformed)?;
            let [child] = children[..] else {
                return Err(malformed());
            };
            let int = match (f.field(4), child.field(4), child.u8(2)) {
                (None, None, Some(ty::INT)) => child.table(3).ok_or_else(malformed)?,
                _ => return Err(format!("column {name:?} is not a list of integers")),
            };
            let bits = int.i32(0).ok_or_else(malformed)?;
            let signed = int.bool(1).ok_or_else(malformed)?;
            use super::DType::*;
            let dtype = match (bits, signed) {
                (8, false) => U8,
                (8, true) => I8,
                (16, false) => U16,
                (16, true) => I16,
                (32, false) => U32,
                (32, true) => I32,
                (64, false) => U64,
                (64, true) => I64,
                _ => return Err(format!("column {name:?} holds {bits}-bit integers")),
            };
            return Ok(Wanted {
                at: place,
                large,
                fixed,
                dtype,
                views_before: place.views,
            });
        }
        let this = String::from_utf8_lossy(this).into_owned();
        skip(f, &mut place, 0).ok_or_else(|| {
            format!(
                "column {this:?} has a type stokehold does not know, nested deeper than \
                 {MAX_DEPTH} levels, or malformed"
            )
        })?;
        names.push(this);
    }
    Err(format!(
        "no column {name:?}; its columns are {}",
        names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The column's chunk in the record batch `batch`, whose body is `body_len` bytes at
/// byte `body` of the file.
fn read_batch(
    batch: Table<'_>,
    wanted: Wanted,
    body: usize,
    body_len: usize,
) -> Result<Chunk, String> {
    let malformed = || "malformed record batch".to_string();
    if batch.field(3).is_some() {
        return Err(
            "compressed record batches (LZ4 or ZSTD buffers) cannot be read in place: \
                    write the table without compression"
                .into(),
        );
    }
    // Where the column's buffers are in this batch: each view column before it adds
    // its variadic buffers (its node, and so the column's, is where `find` counted it).
    let mut at = wanted.at;
    if wanted.views_before > 0 {
        let (n, first) = batch.vector(4).ok_or_else(malformed)?;
        if n < wanted.views_before {
            return Err(malformed());
        }
        // No count passes the batch's buffers, so the sums below stay far from overflow.
        let (buffers, _) = batch.vector(2).ok_or_else(malformed)?;
        for k in 0..wanted.views_before {
            let count = i64_at(batch.buf, first + 8 * k).ok_or_else(malformed)?;
            at.buffer = usize::try_from(count)
                .ok()
                .filter(|&c| c <= buffers)
                .and_then(|c| at.buffer.checked_add(c))
                .filter(|&b| b <= buffers)
                .ok_or_else(malformed)?;
        }
    }
    let struct_at = |slot: usize, k: usize| -> Option<(i64, i64)> {
        let (n, first) = batch.vector(slot)?;
        if k >= n {
            return None;
        }
        let e = first.checked_add(16 * k)?;
        Some((i64_at(batch.buf, e)?, i64_at(batch.buf, e + 8)?))
    };
    let (rows, list_nulls) = struct_at(1, at.node).ok_or_else(malformed)?;
    let (value_count, value_nulls) = struct_at(1, at.node + 1).ok_or_else(malformed)?;
    if list_nulls != 0 || value_nulls != 0 {
        return Err(format!(
            "the column has {list_nulls} null rows and {value_nulls} null tokens: every row \
             must be a list of tokens"
        ));
    }
    let buffer = |k: usize| -> Result<(usize, usize), String> {
        let (off, len) = struct_at(2, k).ok_or_else(malformed)?;
        let (off, len) = (usize::try_from(off), usize::try_from(len));
        match (off, len) {
            (Ok(off), Ok(len)) if off.checked_add(len).is_some_and(|e| e <= body_len) => {
                Ok((body + off, len))
            }
            _ => Err(format!("buffer {k} lies outside its {body_len}-byte body")),
        }
    };
    let rows = u64::try_from(rows).map_err(|_| malformed())?;
    let next = |k: usize| at.buffer.checked_add(k).ok_or_else(malformed);
    // A list's validity, offsets, then its values' validity and data; a fixed-size
    // list has no offsets.
    let (offsets, offsets_len) = match wanted.fixed {
        None => buffer(next(1)?)?,
        Some(_) => (0, 0),
    };
    let data = if wanted.fixed.is_some() { 2 } else { 3 };
    let (values, buffer_len) = buffer(next(data)?)?;
    // The values are the node's count of tokens: a writer pads the buffer past them (to
    // 8 bytes, for the slices of a table written in several batches), and offsets
    // into that padding would serve its bytes as tokens.
    let values_len = usize::try_from(value_count)
        .ok()
        .and_then(|n| n.checked_mul(wanted.dtype.size()))
        .filter(|&n| n <= buffer_len)
        .ok_or_else(|| {
            format!(
                "{value_count} tokens of {} bytes do not fit the {buffer_len}-byte values buffer",
                wanted.dtype.size()
            )
        })?;
    if let Some(n) = wanted.fixed {
        let tokens = rows.checked_mul(n);
        if !tokens.is_some_and(|t| t <= value_count as u64) {
            return Err(format!(
                "{rows} lists of {n} tokens need more than the {value_count} tokens there are"
            ));
        }
    }
    let width = if wanted.large { 8 } else { 4 };
    let needed = (rows as usize)
        .checked_add(1)
        .and_then(|n| n.checked_mul(width));
    if rows > 0 && wanted.fixed.is_none() && !needed.is_some_and(|n| n <= offsets_len) {
        return Err(format!(
            "{rows} lists need {} bytes of offsets, the buffer holds {offsets_len}",
            (u128::from(rows) + 1) * width as u128
        ));
    }
    Ok(Chunk {
        rows,
        offsets,
        large: wanted.large,
        fixed: wanted.fixed,
        values,
        values_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Arrow stream whose schema has one field, a struct nested `depth` levels deep,
    /// each level listing the next `fanout` times as its children (one table), written
    /// as a flatbuffer by hand (pyarrow refuses to write one past 64 levels).
    fn nested_stream(depth: usize, fanout: u32) -> Vec<u8> {
        fn u16s(m: &mut Vec<u8>, v: &[u16]) {
            v.iter().for_each(|x| m.extend(x.to_le_bytes()));
        }
        fn patch(m: &mut [u8], at: usize, to: usize) {
            m[at..at + 4].copy_from_slice(&((to - at) as u32).to_le_bytes());
        }
        let mut m = vec![0u8; 4];
        // vtables: Message (version, header type, header), Schema (fields), Field
        // (type tag at slot 2, children at slot 5).
        let vt_msg = m.len();
        u16s(&mut m, &[10, 12, 4, 6, 8, 0]);
        let vt_schema = m.len();
        u16s(&mut m, &[8, 8, 0, 4]);
        let vt_field = m.len();
        u16s(&mut m, &[16, 12, 0, 0, 4, 0, 0, 8]);
        let msg = m.len();
        m[..4].copy_from_slice(&(msg as u32).to_le_bytes());
        m.extend(((msg - vt_msg) as i32).to_le_bytes());
        m.extend(4i16.to_le_bytes());
        m.extend([1u8, 0]);
        let header = m.len();
        m.extend([0u8; 4]);
        let schema = m.len();
        patch(&mut m, header, schema);
        m.extend(((schema - vt_schema) as i32).to_le_bytes());
        let fields = m.len();
        m.extend([0u8; 4]);
        let mut vector = m.len();
        patch(&mut m, fields, vector);
        for level in 0..depth {
            let count = if level == 0 { 1 } else { fanout };
            m.extend(count.to_le_bytes());
            let elements = m.len();
            m.extend(vec![0u8; 4 * count as usize]);
            let field = m.len();
            for k in 0..count as usize {
                patch(&mut m, elements + 4 * k, field);
            }
            m.extend(((field - vt_field) as i32).to_le_bytes());
            m.extend([ty::STRUCT, 0, 0, 0]);
            let children = m.len();
            m.extend([0u8; 4]);
            vector = m.len();
            patch(&mut m, children, vector);
            if level + 1 == depth {
                m.extend(0u32.to_le_bytes());
            }
        }
        let mut stream = CONTINUATION.to_le_bytes().to_vec();
        stream.extend((m.len() as u32).to_le_bytes());
        stream.extend(m);
        stream.extend(CONTINUATION.to_le_bytes());
        stream.extend(0u32.to_le_bytes());
        stream
    }

    #[test]
    fn files_shorter_than_their_magic_are_errors() {
        // Found by the damaged-files proptest: the file format's magic, cut short.
        for file in [&b"ARROW1\0"[..], b"ARROW1", b"ARROW1\0\0ARROW1", b""] {
            let err = list_column(file, "input_ids").unwrap_err();
            assert!(err.starts_with("not an Arrow IPC stream or file"), "{err}");
        }
    }

    #[test]
    fn nesting_is_read_to_its_bound_and_refused_past_it() {
        // Within the bound the field is walked past (and the column is then missing).
        let err = list_column(&nested_stream(MAX_DEPTH, 1), "input_ids").unwrap_err();
        assert!(err.starts_with("no column \"input_ids\""), "{err}");
        // Far past it: an error, not a stack overflow.
        for depth in [MAX_DEPTH + 2, 200_000] {
            let err = list_column(&nested_stream(depth, 1), "input_ids").unwrap_err();
            assert!(err.contains("nested deeper than 64 levels"), "{err}");
        }
    }

    #[test]
    fn a_second_schema_is_refused() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/arrow/hf_stream.arrow"
        );
        let file = std::fs::read(path).unwrap();
        assert!(list_column(&file, "input_ids").is_ok());
        // The stream's first message is its schema (no body): continuation, length, metadata.
        assert_eq!(u32_at(&file, 0), Some(CONTINUATION));
        let schema = 8 + u32_at(&file, 4).unwrap() as usize;
        let twice = [&file[..schema], &file[..]].concat();
        let err = list_column(&twice, "input_ids").unwrap_err();
        assert!(err.contains("a second schema"), "{err}");
    }

    #[test]
    fn children_listed_many_times_are_refused_not_walked() {
        // Each level lists the next twice: 2^60 fields in a schema of under 2 KB.
        let file = nested_stream(60, 2);
        assert!(file.len() < 2048, "{}", file.len());
        let err = list_column(&file, "input_ids").unwrap_err();
        assert!(err.contains("or malformed"), "{err}");
        // A few repeats, within the bytes of the schema, are walked.
        let err = list_column(&nested_stream(3, 2), "input_ids").unwrap_err();
        assert!(err.starts_with("no column"), "{err}");
    }
}
