//! Reading Python inputs: numpy arrays, CPU torch tensors (through `__array__`, zero-copy) or
//! anything else numpy can view. Every failure is a `ValueError` that starts with the argument's
//! name, so the caller sees which input was wrong without reading Rust.

use numpy::ndarray::Dimension;
use numpy::npyffi::flags::NPY_ARRAY_ALIGNED;
use numpy::{
    dtype, Element, PyArray, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

pub fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

/// Python's spelling of a shape: `(4, 7)`, `(4,)`, `()`.
pub fn shape_str(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!("({})", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// `obj` as a C-contiguous, aligned numpy array; copies only when the input is strided.
pub fn as_array<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
    let py = obj.py();
    let numpy = py.import("numpy")?;
    let arr = match obj.cast::<PyUntypedArray>() {
        Ok(a) => a.clone(),
        Err(_) => numpy
            .call_method1("asarray", (obj,))
            .and_then(|a| a.cast_into::<PyUntypedArray>().map_err(PyErr::from))
            .map_err(|e| {
                let ty = obj.get_type().name().map(|n| n.to_string()).unwrap_or_default();
                value_error(format!(
                    "{name}: expected a numpy array or a CPU tensor, got {ty} that numpy cannot read ({e})"
                ))
            })?,
    };
    // SAFETY: `arr` is a live numpy array; reading its flags field is what PyArray_FLAGS does.
    let aligned = unsafe { (*arr.as_array_ptr()).flags & NPY_ARRAY_ALIGNED != 0 };
    if arr.is_c_contiguous() && aligned {
        return Ok(arr);
    }
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("order", "C")?;
    kwargs.set_item("copy", true)?;
    Ok(numpy.call_method("array", (arr,), Some(&kwargs))?.cast_into::<PyUntypedArray>()?)
}

/// Fails unless `arr` has `ndim` dimensions; `what` names them for the message.
pub fn require_ndim(arr: &Bound<'_, PyUntypedArray>, ndim: usize, name: &str, what: &str) -> PyResult<()> {
    if arr.ndim() != ndim {
        return Err(value_error(format!(
            "{name}: expected a {ndim}-D array {what}, got shape {}",
            shape_str(arr.shape())
        )));
    }
    Ok(())
}

/// Fails unless `arr` has exactly the shape of the argument called `like`.
pub fn require_shape(arr: &Bound<'_, PyUntypedArray>, shape: &[usize], name: &str, like: &str) -> PyResult<()> {
    if arr.shape() != shape {
        return Err(value_error(format!(
            "{name}: expected shape {} like {like}, got {}",
            shape_str(shape),
            shape_str(arr.shape())
        )));
    }
    Ok(())
}

/// A read-only typed view; the dtype must be exactly `T` (no silent casts of float data).
pub fn readonly<'py, T: Element, D: Dimension>(
    arr: &Bound<'py, PyUntypedArray>,
    name: &str,
) -> PyResult<PyReadonlyArray<'py, T, D>> {
    let typed = arr.cast::<PyArray<T, D>>().map_err(|_| {
        value_error(format!("{name}: expected dtype {}, got {}", dtype::<T>(arr.py()), arr.dtype()))
    })?;
    typed.try_readonly().map_err(|e| value_error(format!("{name}: {e}")))
}

/// The contiguous data of a view (guaranteed by `as_array`).
pub fn slice<'a, T: Element, D: Dimension>(ro: &'a PyReadonlyArray<'_, T, D>, name: &str) -> PyResult<&'a [T]> {
    ro.as_slice().map_err(|e| value_error(format!("{name}: {e}")))
}

/// dtype kind and item size, e.g. (b'f', 4) for float32.
pub fn kind(arr: &Bound<'_, PyUntypedArray>) -> (u8, usize) {
    let d = arr.dtype();
    (d.kind(), d.itemsize())
}

/// A 1-D integer array of any integer dtype, widened to i64.
pub fn int_vector(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    let arr = as_array(obj, name)?;
    require_ndim(&arr, 1, name, "[batch]")?;
    if arr.len() == 0 {
        // `[]` reaches us as float64; an empty batch is fine whatever its dtype.
        return Ok(Vec::new());
    }
    fn widen<T: Element + Copy>(arr: &Bound<'_, PyUntypedArray>, name: &str, f: impl Fn(T) -> Option<i64>) -> PyResult<Vec<i64>> {
        let ro = readonly::<T, numpy::Ix1>(arr, name)?;
        slice(&ro, name)?
            .iter()
            .enumerate()
            .map(|(i, &x)| f(x).ok_or_else(|| value_error(format!("{name}: value at index {i} does not fit in int64"))))
            .collect()
    }
    match kind(&arr) {
        (b'i', 1) => widen::<i8>(&arr, name, |x| Some(x as i64)),
        (b'i', 2) => widen::<i16>(&arr, name, |x| Some(x as i64)),
        (b'i', 4) => widen::<i32>(&arr, name, |x| Some(x as i64)),
        (b'i', 8) => widen::<i64>(&arr, name, Some),
        (b'u', 1) => widen::<u8>(&arr, name, |x| Some(x as i64)),
        (b'u', 2) => widen::<u16>(&arr, name, |x| Some(x as i64)),
        (b'u', 4) => widen::<u32>(&arr, name, |x| Some(x as i64)),
        (b'u', 8) => widen::<u64>(&arr, name, |x| i64::try_from(x).ok()),
        _ => Err(value_error(format!("{name}: expected an integer dtype, got {}", arr.dtype()))),
    }
}

/// Scalars such as gamma must be finite numbers.
pub fn finite_scalar(x: f64, name: &str) -> PyResult<f64> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(value_error(format!("{name}: must be a finite number, got {x}")))
    }
}
