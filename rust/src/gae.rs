//! Masked GAE (verl's recurrence), one backward scan per row.
//!
//! Per row, for t = T-1 .. 0 (f32, in exactly this order, no fused multiply-adds, so results
//! agree with the torch reference to rounding):
//!
//! ```text
//! delta = r[t] + gamma * next_value - v[t]
//! g     = delta + (gamma * lam) * last_gae
//! next_value = v[t] * m[t] + (1 - m[t]) * next_value
//! last_gae   = g * m[t] + (1 - m[t]) * last_gae
//! adv[t] = g;  ret[t] = g + v[t]
//! ```
//!
//! Speed: the recurrence is a serial chain along t, so one row at a time runs at the latency
//! of that chain. On x86_64 the rows are taken 8 at a time and scanned side by side in SSE
//! registers (4 rows per register). To feed the registers, tiles of 64 steps are copied row by
//! row (sequential reads) into a small transposed buffer with 4x4 shuffles; reading 8 rows
//! element by element straight from memory instead would put every stream on the same cache
//! sets, since rows are usually a multiple of 4 KiB apart. With AVX (detected at run time) one
//! 256-bit register holds all 8 rows and the next tile is prefetched while one is computed.

use crate::mask::MaskValue;
use rayon::prelude::*;

/// Rows scanned together by one task.
const LANES: usize = 8;

/// Scalars of the recurrence, already rounded to f32 as torch rounds them.
#[derive(Clone, Copy)]
pub struct GaeParams {
    pub gamma: f32,
    /// `gamma * lam`, multiplied in f64 first (as Python does) and then rounded.
    pub gamma_lam: f32,
}

impl GaeParams {
    pub fn new(gamma: f64, lam: f64) -> Self {
        Self { gamma: gamma as f32, gamma_lam: (gamma * lam) as f32 }
    }
}

/// Advantages and returns for a row-major `[rows, t]` batch, written into `adv` and `ret`.
///
/// Returns `false` when a reward, value or mask element was NaN or infinite; the outputs are
/// then meaningless and the caller reports the offending element.
pub fn gae<M: MaskValue>(
    rewards: &[f32],
    values: &[f32],
    mask: &[M],
    t: usize,
    p: GaeParams,
    adv: &mut [f32],
    ret: &mut [f32],
) -> bool {
    let n = rewards.len();
    assert!(values.len() == n && mask.len() == n && adv.len() == n && ret.len() == n);
    if t == 0 || n == 0 {
        return true;
    }
    assert!(n.is_multiple_of(t));
    let chunk = LANES * t;
    adv.par_chunks_mut(chunk)
        .zip(ret.par_chunks_mut(chunk))
        .zip(rewards.par_chunks(chunk))
        .zip(values.par_chunks(chunk))
        .zip(mask.par_chunks(chunk))
        .map(|((((a, o), r), v), m)| {
            #[cfg(target_arch = "x86_64")]
            if r.len() == chunk {
                if std::arch::is_x86_feature_detected!("avx") {
                    // SAFETY: the CPU supports AVX (checked just above).
                    return unsafe { avx::block8(r, v, m, t, p, a, o) };
                }
                return sse::block8(r, v, m, t, p, a, o);
            }
            let mut ok = true;
            for ((((a, o), r), v), m) in
                a.chunks_mut(t).zip(o.chunks_mut(t)).zip(r.chunks(t)).zip(v.chunks(t)).zip(m.chunks(t))
            {
                ok &= row(r, v, m, p, a, o);
            }
            ok
        })
        .reduce(|| true, |x, y| x & y)
}

/// One row, scalar: the reference form of the recurrence (used for leftover rows).
fn row<M: MaskValue>(r: &[f32], v: &[f32], m: &[M], p: GaeParams, adv: &mut [f32], ret: &mut [f32]) -> bool {
    let mut next_value = 0.0f32;
    let mut last_gae = 0.0f32;
    let mut finite = true;
    for ((((&rr, &vv), &mraw), a), o) in r.iter().zip(v).zip(m).zip(adv.iter_mut()).zip(ret.iter_mut()).rev() {
        finite &= rr.is_finite() & vv.is_finite() & mraw.is_finite_value();
        let mm = mraw.to_f32();
        let delta = rr + p.gamma * next_value - vv;
        let g = delta + p.gamma_lam * last_gae;
        let keep = 1.0 - mm;
        next_value = vv * mm + keep * next_value;
        last_gae = g * mm + keep * last_gae;
        *a = g;
        *o = g + vv;
    }
    finite
}

#[cfg(target_arch = "x86_64")]
mod sse {
    //! SSE2 (always present on x86_64) version of `row` for 8 rows at once.
    use super::{GaeParams, MaskValue, LANES};
    use core::arch::x86_64::*;

    /// Timesteps per tile: five tiles (r, v, m, adv, ret) of 8 rows take 10 KiB of L1.
    pub const W: usize = 64;
    pub type Tile = [[f32; LANES]; W];

    pub fn block8<M: MaskValue>(
        r: &[f32],
        v: &[f32],
        m: &[M],
        t: usize,
        p: GaeParams,
        adv: &mut [f32],
        ret: &mut [f32],
    ) -> bool {
        let len = LANES * t;
        assert!(r.len() == len && v.len() == len && m.len() == len && adv.len() == len && ret.len() == len);
        let mut tr: Tile = [[0.0; LANES]; W];
        let mut tv: Tile = [[0.0; LANES]; W];
        let mut tm: Tile = [[0.0; LANES]; W];
        let mut ta: Tile = [[0.0; LANES]; W];
        let mut to: Tile = [[0.0; LANES]; W];
        let mut state = State::new(p);
        let mut finite = true;
        let mut end = t;
        while end > 0 {
            let start = end.saturating_sub(W);
            let w = end - start;
            // SAFETY: for all unsafe calls below, every slice is LANES * t long (asserted above)
            // and start + w <= t, so each row range l * t + start .. l * t + start + w is in
            // bounds; SSE2 is part of the x86_64 baseline.
            unsafe {
                if w == W {
                    finite &= load_tile(r, t, start, &mut tr) & load_tile(v, t, start, &mut tv);
                    finite &= match M::as_f32s(m) {
                        Some(mf) => load_tile(mf, t, start, &mut tm),
                        None => load_tile_scalar(m, t, start, w, &mut tm),
                    };
                } else {
                    finite &= load_tile_scalar(r, t, start, w, &mut tr) & load_tile_scalar(v, t, start, w, &mut tv);
                    finite &= load_tile_scalar(m, t, start, w, &mut tm);
                }
                state.scan(&tr, &tv, &tm, w, &mut ta, &mut to);
                if w == W {
                    store_tile(&ta, t, start, adv);
                    store_tile(&to, t, start, ret);
                } else {
                    store_tile_scalar(&ta, t, start, w, adv);
                    store_tile_scalar(&to, t, start, w, ret);
                }
            }
            end = start;
        }
        finite
    }

    /// The running values of 8 rows, 4 per register.
    struct State {
        gamma: __m128,
        gamma_lam: __m128,
        one: __m128,
        next_value: [__m128; 2],
        last_gae: [__m128; 2],
    }

    impl State {
        fn new(p: GaeParams) -> Self {
            // SAFETY: SSE2 is part of the x86_64 baseline.
            unsafe {
                Self {
                    gamma: _mm_set1_ps(p.gamma),
                    gamma_lam: _mm_set1_ps(p.gamma_lam),
                    one: _mm_set1_ps(1.0),
                    next_value: [_mm_setzero_ps(); 2],
                    last_gae: [_mm_setzero_ps(); 2],
                }
            }
        }

        /// Steps w-1 .. 0 of a transposed tile (tile[k] holds step k of the 8 rows).
        #[inline(always)]
        unsafe fn scan(&mut self, tr: &Tile, tv: &Tile, tm: &Tile, w: usize, ta: &mut Tile, to: &mut Tile) {
            for k in (0..w.min(W)).rev() {
                for h in 0..2 {
                    let rr = _mm_loadu_ps(tr[k].as_ptr().add(4 * h));
                    let vv = _mm_loadu_ps(tv[k].as_ptr().add(4 * h));
                    let mm = _mm_loadu_ps(tm[k].as_ptr().add(4 * h));
                    let delta = _mm_sub_ps(_mm_add_ps(rr, _mm_mul_ps(self.gamma, self.next_value[h])), vv);
                    let g = _mm_add_ps(delta, _mm_mul_ps(self.gamma_lam, self.last_gae[h]));
                    let keep = _mm_sub_ps(self.one, mm);
                    self.next_value[h] = _mm_add_ps(_mm_mul_ps(vv, mm), _mm_mul_ps(keep, self.next_value[h]));
                    self.last_gae[h] = _mm_add_ps(_mm_mul_ps(g, mm), _mm_mul_ps(keep, self.last_gae[h]));
                    _mm_storeu_ps(ta[k].as_mut_ptr().add(4 * h), g);
                    _mm_storeu_ps(to[k].as_mut_ptr().add(4 * h), _mm_add_ps(g, vv));
                }
            }
        }
    }

    /// Copy steps start..start+W of the 8 rows into `tile` transposed; false on NaN/inf.
    #[inline(always)]
    unsafe fn load_tile(src: &[f32], t: usize, start: usize, tile: &mut Tile) -> bool {
        let zero = _mm_setzero_ps();
        let mut ok = _mm_cmpeq_ps(zero, zero);
        for g in (0..LANES).step_by(4) {
            let p0 = src.as_ptr().add(g * t + start);
            let (p1, p2, p3) = (p0.add(t), p0.add(2 * t), p0.add(3 * t));
            for k in (0..W).step_by(4) {
                let mut a = _mm_loadu_ps(p0.add(k));
                let mut b = _mm_loadu_ps(p1.add(k));
                let mut c = _mm_loadu_ps(p2.add(k));
                let mut d = _mm_loadu_ps(p3.add(k));
                // x - x is 0 exactly when x is finite.
                let fin = _mm_and_ps(
                    _mm_and_ps(_mm_cmpeq_ps(_mm_sub_ps(a, a), zero), _mm_cmpeq_ps(_mm_sub_ps(b, b), zero)),
                    _mm_and_ps(_mm_cmpeq_ps(_mm_sub_ps(c, c), zero), _mm_cmpeq_ps(_mm_sub_ps(d, d), zero)),
                );
                ok = _mm_and_ps(ok, fin);
                _MM_TRANSPOSE4_PS(&mut a, &mut b, &mut c, &mut d);
                _mm_storeu_ps(tile[k].as_mut_ptr().add(g), a);
                _mm_storeu_ps(tile[k + 1].as_mut_ptr().add(g), b);
                _mm_storeu_ps(tile[k + 2].as_mut_ptr().add(g), c);
                _mm_storeu_ps(tile[k + 3].as_mut_ptr().add(g), d);
            }
        }
        _mm_movemask_ps(ok) == 0xF
    }

    /// Inverse of `load_tile`: write the tile's W steps back into the 8 rows.
    #[inline(always)]
    unsafe fn store_tile(tile: &Tile, t: usize, start: usize, dst: &mut [f32]) {
        for g in (0..LANES).step_by(4) {
            let p0 = dst.as_mut_ptr().add(g * t + start);
            let (p1, p2, p3) = (p0.add(t), p0.add(2 * t), p0.add(3 * t));
            for k in (0..W).step_by(4) {
                let mut a = _mm_loadu_ps(tile[k].as_ptr().add(g));
                let mut b = _mm_loadu_ps(tile[k + 1].as_ptr().add(g));
                let mut c = _mm_loadu_ps(tile[k + 2].as_ptr().add(g));
                let mut d = _mm_loadu_ps(tile[k + 3].as_ptr().add(g));
                _MM_TRANSPOSE4_PS(&mut a, &mut b, &mut c, &mut d);
                _mm_storeu_ps(p0.add(k), a);
                _mm_storeu_ps(p1.add(k), b);
                _mm_storeu_ps(p2.add(k), c);
                _mm_storeu_ps(p3.add(k), d);
            }
        }
    }

    /// Element-wise `load_tile` for short tiles and non-f32 masks.
    #[inline(always)]
    pub unsafe fn load_tile_scalar<M: MaskValue>(src: &[M], t: usize, start: usize, w: usize, tile: &mut Tile) -> bool {
        let mut ok = true;
        for l in 0..LANES {
            for (k, &x) in src[l * t + start..l * t + start + w].iter().enumerate() {
                ok &= x.is_finite_value();
                tile[k][l] = x.to_f32();
            }
        }
        ok
    }

    #[inline(always)]
    pub unsafe fn store_tile_scalar(tile: &Tile, t: usize, start: usize, w: usize, dst: &mut [f32]) {
        for l in 0..LANES {
            for (k, x) in dst[l * t + start..l * t + start + w].iter_mut().enumerate() {
                *x = tile[k][l];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    //! AVX version of `sse::block8`: all 8 rows in one 256-bit register, 8x8 transposes.
    use super::sse::{load_tile_scalar, store_tile_scalar, Tile, W};
    use super::{GaeParams, MaskValue, LANES};
    use core::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX.
    #[target_feature(enable = "avx")]
    pub unsafe fn block8<M: MaskValue>(
        r: &[f32],
        v: &[f32],
        m: &[M],
        t: usize,
        p: GaeParams,
        adv: &mut [f32],
        ret: &mut [f32],
    ) -> bool {
        let len = LANES * t;
        assert!(r.len() == len && v.len() == len && m.len() == len && adv.len() == len && ret.len() == len);
        let mut tr: Tile = [[0.0; LANES]; W];
        let mut tv: Tile = [[0.0; LANES]; W];
        let mut tm: Tile = [[0.0; LANES]; W];
        let mut ta: Tile = [[0.0; LANES]; W];
        let mut to: Tile = [[0.0; LANES]; W];
        let gamma = _mm256_set1_ps(p.gamma);
        let gamma_lam = _mm256_set1_ps(p.gamma_lam);
        let one = _mm256_set1_ps(1.0);
        let mut next_value = _mm256_setzero_ps();
        let mut last_gae = _mm256_setzero_ps();
        let mut finite = true;
        let mut end = t;
        while end > 0 {
            let start = end.saturating_sub(W);
            let w = end - start;
            // SAFETY: as in `sse::block8`: every row range l * t + start .. + w is in bounds,
            // and so is the previous tile's range that we prefetch.
            if start >= W {
                // 24 backward streams are more than the hardware prefetcher follows: ask for
                // the next tile's inputs (one line per 16 floats) while this one is computed.
                for l in 0..LANES {
                    let i = l * t + start - W;
                    for off in (0..W).step_by(16) {
                        _mm_prefetch::<_MM_HINT_T0>(r.as_ptr().add(i + off) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().add(i + off) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(m.as_ptr().add(i + off) as *const i8);
                    }
                }
            }
            if w == W {
                finite &= load_tile(r, t, start, &mut tr) & load_tile(v, t, start, &mut tv);
                finite &= match M::as_f32s(m) {
                    Some(mf) => load_tile(mf, t, start, &mut tm),
                    None => load_tile_scalar(m, t, start, w, &mut tm),
                };
            } else {
                finite &= load_tile_scalar(r, t, start, w, &mut tr) & load_tile_scalar(v, t, start, w, &mut tv);
                finite &= load_tile_scalar(m, t, start, w, &mut tm);
            }
            for k in (0..w).rev() {
                let rr = _mm256_loadu_ps(tr[k].as_ptr());
                let vv = _mm256_loadu_ps(tv[k].as_ptr());
                let mm = _mm256_loadu_ps(tm[k].as_ptr());
                let delta = _mm256_sub_ps(_mm256_add_ps(rr, _mm256_mul_ps(gamma, next_value)), vv);
                let g = _mm256_add_ps(delta, _mm256_mul_ps(gamma_lam, last_gae));
                let keep = _mm256_sub_ps(one, mm);
                next_value = _mm256_add_ps(_mm256_mul_ps(vv, mm), _mm256_mul_ps(keep, next_value));
                last_gae = _mm256_add_ps(_mm256_mul_ps(g, mm), _mm256_mul_ps(keep, last_gae));
                _mm256_storeu_ps(ta[k].as_mut_ptr(), g);
                _mm256_storeu_ps(to[k].as_mut_ptr(), _mm256_add_ps(g, vv));
            }
            if w == W {
                store_tile(&ta, t, start, adv);
                store_tile(&to, t, start, ret);
            } else {
                store_tile_scalar(&ta, t, start, w, adv);
                store_tile_scalar(&to, t, start, w, ret);
            }
            end = start;
        }
        finite
    }

    /// Transpose an 8x8 block held as 8 registers (row i -> register i becomes column i).
    #[target_feature(enable = "avx")]
    #[inline]
    fn transpose8(x: &mut [__m256; 8]) {
        let t0 = _mm256_unpacklo_ps(x[0], x[1]);
        let t1 = _mm256_unpackhi_ps(x[0], x[1]);
        let t2 = _mm256_unpacklo_ps(x[2], x[3]);
        let t3 = _mm256_unpackhi_ps(x[2], x[3]);
        let t4 = _mm256_unpacklo_ps(x[4], x[5]);
        let t5 = _mm256_unpackhi_ps(x[4], x[5]);
        let t6 = _mm256_unpacklo_ps(x[6], x[7]);
        let t7 = _mm256_unpackhi_ps(x[6], x[7]);
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        x[0] = _mm256_permute2f128_ps::<0x20>(s0, s4);
        x[1] = _mm256_permute2f128_ps::<0x20>(s1, s5);
        x[2] = _mm256_permute2f128_ps::<0x20>(s2, s6);
        x[3] = _mm256_permute2f128_ps::<0x20>(s3, s7);
        x[4] = _mm256_permute2f128_ps::<0x31>(s0, s4);
        x[5] = _mm256_permute2f128_ps::<0x31>(s1, s5);
        x[6] = _mm256_permute2f128_ps::<0x31>(s2, s6);
        x[7] = _mm256_permute2f128_ps::<0x31>(s3, s7);
    }

    /// Copy steps start..start+W of the 8 rows into `tile` transposed; false on NaN/inf.
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn load_tile(src: &[f32], t: usize, start: usize, tile: &mut Tile) -> bool {
        let zero = _mm256_setzero_ps();
        let mut ok = _mm256_cmp_ps::<_CMP_EQ_OQ>(zero, zero);
        let base = src.as_ptr().add(start);
        for k in (0..W).step_by(8) {
            let mut x = [zero; 8];
            for (l, xl) in x.iter_mut().enumerate() {
                *xl = _mm256_loadu_ps(base.add(l * t + k));
                // x - x is 0 exactly when x is finite.
                ok = _mm256_and_ps(ok, _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_sub_ps(*xl, *xl), zero));
            }
            transpose8(&mut x);
            for (j, xj) in x.iter().enumerate() {
                _mm256_storeu_ps(tile[k + j].as_mut_ptr(), *xj);
            }
        }
        _mm256_movemask_ps(ok) == 0xFF
    }

    /// Inverse of `load_tile`.
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn store_tile(tile: &Tile, t: usize, start: usize, dst: &mut [f32]) {
        let base = dst.as_mut_ptr().add(start);
        for k in (0..W).step_by(8) {
            let mut x = [_mm256_setzero_ps(); 8];
            for (j, xj) in x.iter_mut().enumerate() {
                *xj = _mm256_loadu_ps(tile[k + j].as_ptr());
            }
            transpose8(&mut x);
            for (l, xl) in x.iter().enumerate() {
                _mm256_storeu_ps(base.add(l * t + k), *xl);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_two_steps() {
        // gamma=0.5, lam=1: t=1: delta = 1 - 0.5 = 0.5, adv=0.5; t=0: delta = 0 + 0.5*0.5 - 1
        // = -0.75, adv = -0.75 + 0.5*0.5 = -0.5.
        let r = [0.0, 1.0];
        let v = [1.0, 0.5];
        let m = [1.0f32, 1.0];
        let (mut a, mut o) = ([0.0; 2], [0.0; 2]);
        assert!(gae(&r, &v, &m, 2, GaeParams::new(0.5, 1.0), &mut a, &mut o));
        assert_eq!(a, [-0.5, 0.5]);
        assert_eq!(o, [0.5, 1.0]);
    }

    /// The 8-row SIMD path equals the scalar row path bit for bit, for full and partial tiles.
    #[test]
    fn blocked_equals_rows() {
        for &t in &[1usize, 3, 64, 67, 200] {
            let b = 19; // two blocks of 8 and three leftover rows
            let n = b * t;
            let r: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
            let v: Vec<f32> = (0..n).map(|i| ((i * 104729) % 997) as f32 / 300.0).collect();
            let m: Vec<f32> = (0..n).map(|i| if (i * 31) % 7 < 2 { 0.0 } else { 1.0 }).collect();
            let p = GaeParams::new(0.99, 0.95);
            let (mut a, mut o) = (vec![0.0; n], vec![0.0; n]);
            assert!(gae(&r, &v, &m, t, p, &mut a, &mut o));
            let mb: Vec<u8> = m.iter().map(|&x| x as u8).collect();
            let (mut a2, mut o2) = (vec![0.0; n], vec![0.0; n]);
            assert!(gae(&r, &v, &mb, t, p, &mut a2, &mut o2));
            for i in 0..b {
                let s = i * t..(i + 1) * t;
                let (mut ea, mut eo) = (vec![0.0; t], vec![0.0; t]);
                row(&r[s.clone()], &v[s.clone()], &m[s.clone()], p, &mut ea, &mut eo);
                assert_eq!(&a[s.clone()], &ea[..], "adv t={t} row={i}");
                assert_eq!(&o[s.clone()], &eo[..], "ret t={t} row={i}");
                assert_eq!(&a2[s.clone()], &ea[..], "u8 mask t={t} row={i}");
                assert_eq!(&o2[s], &eo[..]);
            }
        }
    }

    /// Both x86 SIMD paths, called directly, equal the scalar rows bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn sse_and_avx_paths_equal_rows() {
        for &t in &[64usize, 130, 5] {
            let n = 8 * t;
            let r: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0).collect();
            let v: Vec<f32> = (0..n).map(|i| ((i * 104729) % 997) as f32 / 300.0).collect();
            let m: Vec<f32> = (0..n).map(|i| if (i * 31) % 7 < 2 { 0.0 } else { 1.0 }).collect();
            let p = GaeParams::new(0.97, 0.9);
            let (mut ea, mut eo) = (vec![0.0; n], vec![0.0; n]);
            for l in 0..8 {
                let s = l * t..(l + 1) * t;
                row(&r[s.clone()], &v[s.clone()], &m[s.clone()], p, &mut ea[s.clone()], &mut eo[s]);
            }
            let (mut a, mut o) = (vec![0.0; n], vec![0.0; n]);
            assert!(sse::block8(&r, &v, &m, t, p, &mut a, &mut o));
            assert_eq!((&a, &o), (&ea, &eo), "sse t={t}");
            if std::arch::is_x86_feature_detected!("avx") {
                let (mut a, mut o) = (vec![0.0; n], vec![0.0; n]);
                // SAFETY: AVX support checked above.
                assert!(unsafe { avx::block8(&r, &v, &m, t, p, &mut a, &mut o) });
                assert_eq!((&a, &o), (&ea, &eo), "avx t={t}");
                let mut bad = v.clone();
                bad[3 * t + t / 2] = f32::INFINITY;
                // SAFETY: AVX support checked above.
                assert!(!unsafe { avx::block8(&r, &bad, &m, t, p, &mut a, &mut o) });
            }
        }
    }

    #[test]
    fn nonfinite_is_reported_on_every_path() {
        for &(t, pos) in &[(64usize, 8 * 64 - 1), (67, 5), (64, 8 * 64 + 3)] {
            let n = 9 * t;
            let mut r = vec![0.5f32; n];
            r[pos] = f32::NAN;
            let (v, m) = (vec![1.0f32; n], vec![1.0f32; n]);
            let (mut a, mut o) = (vec![0.0; n], vec![0.0; n]);
            assert!(!gae(&r, &v, &m, t, GaeParams::new(1.0, 1.0), &mut a, &mut o));
        }
    }
}
