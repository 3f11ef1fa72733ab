//! Little-endian bytes of element slices, and elements back from them: the
//! byte order of checkpoints, of the param store's shards and of the
//! weights' hash.
//!
//! On a little-endian host the bytes are the slice's own memory, viewed in
//! place ([`bytes`] borrows), where the code before built a new vector one
//! element at a time (`flat_map(to_le_bytes).collect()`, four copies of
//! it). A big-endian host converts.

use std::borrow::Cow;

/// `v`'s elements as little-endian bytes.
pub fn bytes<T: bytemuck::Pod>(v: &[T]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(
            v.iter()
                .flat_map(|x| bytemuck::bytes_of(x).iter().rev().copied())
                .collect(),
        )
    }
}

/// The `f32`s of little-endian bytes (`b.len()` a multiple of 4; a
/// trailing part of an element is ignored).
pub fn f32s(b: &[u8]) -> Vec<f32> {
    let b = &b[..b.len() / 4 * 4];
    if cfg!(target_endian = "little") {
        let mut out = vec![0f32; b.len() / 4];
        bytemuck::cast_slice_mut::<f32, u8>(&mut out).copy_from_slice(b);
        out
    } else {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the per-element conversion, at awkward lengths and from an
    /// unaligned start.
    #[test]
    fn bytes_and_back_match_the_per_element_conversion() {
        for n in [0usize, 1, 3, 1023, 4097] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 - 7.5) * 1.25e-3).collect();
            let want: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(&*bytes(&v), &want[..]);
            let h: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let want16: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
            assert_eq!(&*bytes(&h), &want16[..]);
            let mut shifted = vec![0u8];
            shifted.extend_from_slice(&want);
            let back = f32s(&shifted[1..]);
            assert_eq!(
                back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
