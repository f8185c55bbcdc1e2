//! Mask element types: masks arrive as float32, bool or any integer dtype, and the kernels read
//! them in place (no converted copy) through this trait.

/// A mask element the kernels can read as an `f32` weight.
pub trait MaskValue: Copy + Send + Sync {
    /// Whether values of this type can be NaN or infinite (only floats can).
    const MAY_BE_NONFINITE: bool;
    fn to_f32(self) -> f32;
    fn is_finite_value(self) -> bool {
        true
    }
    /// The data itself when it already is f32 (lets SIMD paths load it directly).
    fn as_f32s(data: &[Self]) -> Option<&[f32]> {
        let _ = data;
        None
    }
}

impl MaskValue for f32 {
    const MAY_BE_NONFINITE: bool = true;
    fn as_f32s(data: &[Self]) -> Option<&[f32]> {
        Some(data)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn is_finite_value(self) -> bool {
        self.is_finite()
    }
}

impl MaskValue for f64 {
    const MAY_BE_NONFINITE: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline(always)]
    fn is_finite_value(self) -> bool {
        self.is_finite()
    }
}

impl MaskValue for bool {
    const MAY_BE_NONFINITE: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        if self {
            1.0
        } else {
            0.0
        }
    }
}

macro_rules! int_mask {
    ($($t:ty),*) => {$(
        impl MaskValue for $t {
            const MAY_BE_NONFINITE: bool = false;
            #[inline(always)]
            fn to_f32(self) -> f32 {
                self as f32
            }
        }
    )*};
}
int_mask!(i8, i16, i32, i64, u8, u16, u32, u64);

/// Position of the first non-finite element of a row-major `[rows, cols]` buffer.
pub fn first_nonfinite<M: MaskValue>(data: &[M], cols: usize) -> Option<(usize, usize)> {
    if !M::MAY_BE_NONFINITE {
        return None;
    }
    data.iter()
        .position(|x| !x.is_finite_value())
        .map(|i| (i.checked_div(cols).unwrap_or(0), i.checked_rem(cols).unwrap_or(0)))
}
