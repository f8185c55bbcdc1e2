//! Discounted returns with mask resets (verl's REINFORCE++ outcome returns).
//!
//! Per row, backwards: `running = r[t] + gamma * running; out[t] = running; running *= m[t]`.
//! A masked-out position is written first and only then resets the sum, so everything after
//! the response (mask 0) never leaks into it. Rows are interleaved like in `gae`.

use crate::mask::MaskValue;
use rayon::prelude::*;

const LANES: usize = 8;

/// Returns `false` when a reward or mask element was NaN or infinite.
pub fn discounted_returns<M: MaskValue>(
    rewards: &[f32],
    mask: &[M],
    t: usize,
    gamma: f32,
    out: &mut [f32],
) -> bool {
    let n = rewards.len();
    assert!(mask.len() == n && out.len() == n);
    if t == 0 || n == 0 {
        return true;
    }
    assert!(n.is_multiple_of(t));
    let chunk = LANES * t;
    out.par_chunks_mut(chunk)
        .zip(rewards.par_chunks(chunk))
        .zip(mask.par_chunks(chunk))
        .map(|((o, r), m)| {
            if r.len() == chunk {
                block::<LANES, M>(r, m, t, gamma, o)
            } else {
                let mut ok = true;
                for ((o, r), m) in o.chunks_mut(t).zip(r.chunks(t)).zip(m.chunks(t)) {
                    ok &= block::<1, M>(r, m, t, gamma, o);
                }
                ok
            }
        })
        .reduce(|| true, |x, y| x & y)
}

#[inline(always)]
fn block<const L: usize, M: MaskValue>(r: &[f32], m: &[M], t: usize, gamma: f32, out: &mut [f32]) -> bool {
    let len = L * t;
    assert!(r.len() == len && m.len() == len && out.len() == len);
    let mut running = [0.0f32; L];
    let mut finite = true;
    for j in (0..t).rev() {
        for (l, run) in running.iter_mut().enumerate() {
            let i = l * t + j;
            // SAFETY: l < L and j < t, so i < L * t == the length of every slice (asserted).
            let (rr, mraw) = unsafe { (*r.get_unchecked(i), *m.get_unchecked(i)) };
            finite &= rr.is_finite() & mraw.is_finite_value();
            let mm = mraw.to_f32();
            let x = rr + gamma * *run;
            // SAFETY: as above.
            unsafe { *out.get_unchecked_mut(i) = x };
            *run = x * mm;
        }
    }
    finite
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_after_masked_position() {
        // mask [1, 1, 0]: t=2 -> 4 (then reset), t=1 -> 2, t=0 -> 1 + 0.5*2 = 2.
        let r = [1.0, 2.0, 4.0];
        let m = [1u8, 1, 0];
        let mut o = [0.0; 3];
        assert!(discounted_returns(&r, &m, 3, 0.5, &mut o));
        assert_eq!(o, [2.0, 2.0, 4.0]);
    }
}
