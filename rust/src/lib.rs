//! rlcore._native: the numeric core of rlcore.
//!
//! This file is only the Python boundary: read and validate inputs (errors name the argument),
//! release the GIL, call a kernel from its own module, wrap the result as numpy. The kernels
//! themselves are plain Rust over slices.

mod gae;
mod group;
mod input;
mod mask;
mod packing;
mod partition;
mod returns;

use input::{as_array, finite_scalar, int_vector, kind, readonly, require_ndim, require_shape, shape_str, slice, value_error};
use mask::{first_nonfinite, MaskValue};
use numpy::{Ix1, Ix2, PyArray1, PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// Run `$body` with `$m` bound to the mask's data as a slice of its own element type
/// (float32/float64/bool/any integer), so kernels read the mask in place.
macro_rules! with_mask {
    ($arr:expr, $name:expr, |$m:ident| $body:expr) => {{
        let arr: &Bound<'_, PyUntypedArray> = $arr;
        macro_rules! typed {
            ($t:ty) => {{
                let ro = readonly::<$t, Ix2>(arr, $name)?;
                let $m: &[$t] = slice(&ro, $name)?;
                $body
            }};
        }
        match kind(arr) {
            (b'f', 4) => typed!(f32),
            (b'f', 8) => typed!(f64),
            (b'b', 1) => typed!(bool),
            (b'i', 1) => typed!(i8),
            (b'i', 2) => typed!(i16),
            (b'i', 4) => typed!(i32),
            (b'i', 8) => typed!(i64),
            (b'u', 1) => typed!(u8),
            (b'u', 2) => typed!(u16),
            (b'u', 4) => typed!(u32),
            (b'u', 8) => typed!(u64),
            _ => {
                return Err(value_error(format!(
                    "{}: expected a float32, float64, bool or integer dtype, got {}",
                    $name,
                    arr.dtype()
                )))
            }
        }
    }};
}

/// Error for the first NaN/inf among the named `[rows, cols]` inputs, in argument order.
fn nonfinite_error<M: MaskValue>(named: &[(&str, &[f32])], mask: Option<(&str, &[M])>, cols: usize) -> PyErr {
    let found = named
        .iter()
        .find_map(|(name, data)| first_nonfinite(data, cols).map(|pos| (*name, pos)))
        .or_else(|| mask.and_then(|(name, data)| first_nonfinite(data, cols).map(|pos| (name, pos))));
    match found {
        Some((name, (r, c))) => value_error(format!("{name}: contains NaN or inf (first at [{r}, {c}])")),
        None => value_error("inputs: contain NaN or inf"),
    }
}

/// An uninitialised `[b, t]` float32 output that the kernels overwrite completely. Allocated
/// by numpy (not by Rust) so large outputs reuse numpy's freed buffers instead of faulting in
/// fresh zeroed pages on every call.
fn new_matrix(py: Python<'_>, b: usize, t: usize) -> Bound<'_, PyArray2<f32>> {
    // SAFETY: every element is written by the kernel before the array reaches Python; on the
    // error path the array is dropped unread.
    unsafe { PyArray2::<f32>::new(py, [b, t], false) }
}

fn out_slice<'a>(rw: &'a mut PyReadwriteArray2<'_, f32>) -> PyResult<&'a mut [f32]> {
    rw.as_slice_mut().map_err(|e| value_error(format!("internal: output not contiguous: {e}")))
}

/// Reads a 2-D float32 `[batch, tokens]` argument.
fn tokens_f32<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    let arr = as_array(obj, name)?;
    require_ndim(&arr, 2, name, "[batch, tokens]")?;
    Ok(arr)
}

type AdvantagesAndReturns<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>);

/// Masked GAE (verl's recurrence); see rlcore/_native.pyi.
#[pyfunction]
#[pyo3(name = "gae", signature = (rewards, values, mask, gamma, lam))]
fn py_gae<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    values: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    gamma: f64,
    lam: f64,
) -> PyResult<AdvantagesAndReturns<'py>> {
    let params = gae::GaeParams::new(finite_scalar(gamma, "gamma")?, finite_scalar(lam, "lam")?);
    let r_arr = tokens_f32(rewards, "rewards")?;
    let shape = r_arr.shape().to_vec();
    let (b, t) = (shape[0], shape[1]);
    let v_arr = as_array(values, "values")?;
    require_shape(&v_arr, &shape, "values", "rewards")?;
    let m_arr = as_array(mask, "mask")?;
    require_shape(&m_arr, &shape, "mask", "rewards")?;
    let r_ro = readonly::<f32, Ix2>(&r_arr, "rewards")?;
    let v_ro = readonly::<f32, Ix2>(&v_arr, "values")?;
    let (r, v) = (slice(&r_ro, "rewards")?, slice(&v_ro, "values")?);

    let (adv_arr, ret_arr) = (new_matrix(py, b, t), new_matrix(py, b, t));
    {
        let (mut adv_rw, mut ret_rw) = (adv_arr.readwrite(), ret_arr.readwrite());
        let (adv, ret) = (out_slice(&mut adv_rw)?, out_slice(&mut ret_rw)?);
        with_mask!(&m_arr, "mask", |m| {
            let finite = py.detach(|| gae::gae(r, v, m, t, params, adv, ret));
            if !finite {
                return Err(nonfinite_error(&[("rewards", r), ("values", v)], Some(("mask", m)), t));
            }
        });
    }
    Ok((adv_arr, ret_arr))
}

/// Discounted returns with resets at masked positions (verl's REINFORCE++).
#[pyfunction]
#[pyo3(name = "discounted_returns", signature = (rewards, mask, gamma))]
fn py_discounted_returns<'py>(
    py: Python<'py>,
    rewards: &Bound<'py, PyAny>,
    mask: &Bound<'py, PyAny>,
    gamma: f64,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let gamma = finite_scalar(gamma, "gamma")? as f32;
    let r_arr = tokens_f32(rewards, "rewards")?;
    let shape = r_arr.shape().to_vec();
    let (b, t) = (shape[0], shape[1]);
    let m_arr = as_array(mask, "mask")?;
    require_shape(&m_arr, &shape, "mask", "rewards")?;
    let r_ro = readonly::<f32, Ix2>(&r_arr, "rewards")?;
    let r = slice(&r_ro, "rewards")?;

    let out_arr = new_matrix(py, b, t);
    {
        let mut out_rw = out_arr.readwrite();
        let out = out_slice(&mut out_rw)?;
        with_mask!(&m_arr, "mask", |m| {
            let finite = py.detach(|| returns::discounted_returns(r, m, t, gamma, out));
            if !finite {
                return Err(nonfinite_error(&[("rewards", r)], Some(("mask", m)), t));
            }
        });
    }
    Ok(out_arr)
}

/// Outcome advantages normalised within groups (GRPO, Dr. GRPO, RLOO, REINFORCE++ baseline).
#[pyfunction]
#[pyo3(name = "group_advantages", signature = (scores, group_ids, mode = "grpo", eps = 1e-6))]
fn py_group_advantages<'py>(
    py: Python<'py>,
    scores: &Bound<'py, PyAny>,
    group_ids: &Bound<'py, PyAny>,
    mode: &str,
    eps: f64,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let mode = group::Mode::parse(mode)
        .ok_or_else(|| value_error(format!("mode: unknown '{mode}'; expected one of {}", group::MODE_NAMES)))?;
    let eps = finite_scalar(eps, "eps")?;
    if eps < 0.0 {
        return Err(value_error(format!("eps: must be >= 0, got {eps}")));
    }
    let s_arr = as_array(scores, "scores")?;
    require_ndim(&s_arr, 1, "scores", "[batch]")?;
    let s_ro = readonly::<f32, Ix1>(&s_arr, "scores")?;
    let s = slice(&s_ro, "scores")?;
    if let Some((_, i)) = first_nonfinite(s, s.len().max(1)) {
        return Err(value_error(format!("scores: contains NaN or inf (first at index {i})")));
    }
    let ids = int_vector(group_ids, "group_ids")?;
    if ids.len() != s.len() {
        return Err(value_error(format!(
            "group_ids: expected shape {} like scores, got {}",
            shape_str(&[s.len()]),
            shape_str(&[ids.len()])
        )));
    }
    let out = py.detach(|| group::group_advantages(s, &ids, mode, eps));
    Ok(PyArray1::from_vec(py, out))
}

/// Validated non-negative lengths whose total fits in int64.
fn lengths_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let lengths = int_vector(obj, "lengths")?;
    let mut total: i64 = 0;
    for (i, &x) in lengths.iter().enumerate() {
        if x < 0 {
            return Err(value_error(format!("lengths: must be >= 0, got {x} at index {i}")));
        }
        total = total.checked_add(x).ok_or_else(|| value_error("lengths: total does not fit in int64"))?;
    }
    Ok(lengths)
}

/// Micro-batches of sample indices within a token budget (first-fit decreasing).
#[pyfunction]
#[pyo3(name = "pack_token_budget", signature = (lengths, max_tokens))]
fn py_pack_token_budget(py: Python<'_>, lengths: &Bound<'_, PyAny>, max_tokens: i64) -> PyResult<Vec<Vec<usize>>> {
    if max_tokens < 1 {
        return Err(value_error(format!("max_tokens: must be >= 1, got {max_tokens}")));
    }
    let lengths = lengths_arg(lengths)?;
    Ok(py.detach(|| packing::pack_token_budget(&lengths, max_tokens)))
}

/// k partitions with near-equal length totals (Karmarkar-Karp largest differencing).
#[pyfunction]
#[pyo3(name = "balanced_partitions", signature = (lengths, k, equal_size = true))]
fn py_balanced_partitions(
    py: Python<'_>,
    lengths: &Bound<'_, PyAny>,
    k: i64,
    equal_size: bool,
) -> PyResult<Vec<Vec<usize>>> {
    if k < 1 {
        return Err(value_error(format!("k: must be >= 1, got {k}")));
    }
    let lengths = lengths_arg(lengths)?;
    let n = lengths.len();
    let k = usize::try_from(k).map_err(|_| value_error(format!("k: too large ({k})")))?;
    if n < k {
        return Err(value_error(format!("lengths: need at least k={k} items to fill {k} partitions, got {n}")));
    }
    if equal_size && n % k != 0 {
        return Err(value_error(format!(
            "lengths: equal_size needs a length divisible by k={k}, got {n} items"
        )));
    }
    Ok(py.detach(|| partition::balanced_partitions(&lengths, k, equal_size)))
}

/// The crate's version, exported as `__version__`: `import rlcore` compares it with its own and
/// refuses a stale build (an extension left over from another version of the sources).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", VERSION)?;
    m.add_function(wrap_pyfunction!(py_gae, m)?)?;
    m.add_function(wrap_pyfunction!(py_discounted_returns, m)?)?;
    m.add_function(wrap_pyfunction!(py_group_advantages, m)?)?;
    m.add_function(wrap_pyfunction!(py_pack_token_budget, m)?)?;
    m.add_function(wrap_pyfunction!(py_balanced_partitions, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyo3::exceptions::PyValueError;

    /// The module as Python sees it, in an embedded interpreter (this is why the
    /// `extension-module` feature is off for `cargo test`: the test binary links libpython).
    #[test]
    fn module_exports_version_and_functions_that_validate_at_the_boundary() {
        Python::initialize();
        Python::attach(|py| {
            let module = pyo3::wrap_pymodule!(_native)(py);
            let m = module.bind(py);
            let version: String = m.getattr("__version__").unwrap().extract().unwrap();
            assert_eq!(version, VERSION);
            for name in ["gae", "discounted_returns", "group_advantages", "pack_token_budget", "balanced_partitions"] {
                assert!(m.hasattr(name).unwrap(), "{name} is not exported");
            }
            // Scalar arguments are checked before any array is read, so no numpy is needed here.
            let err = m.getattr("pack_token_budget").unwrap().call1((vec![1_i64, 2], 0)).unwrap_err();
            assert!(err.is_instance_of::<PyValueError>(py));
            assert_eq!(err.value(py).to_string(), "max_tokens: must be >= 1, got 0");
            let err = m.getattr("balanced_partitions").unwrap().call1((vec![1_i64, 2], 0)).unwrap_err();
            assert_eq!(err.value(py).to_string(), "k: must be >= 1, got 0");
        });
    }
}
