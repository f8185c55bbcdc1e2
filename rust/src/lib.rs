//! rlcore._native: the numeric core of rlcore (placeholder until the kernels land).
use pyo3::prelude::*;

#[pymodule]
fn _native(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
