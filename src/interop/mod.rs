//! Handing batches to the frameworks training loops are written in. Each framework is a
//! feature of its own; this layer sits above the loader and imports nothing from the
//! backends.

#[cfg(feature = "candle")]
pub mod candle;

#[cfg(feature = "burn")]
pub mod burn;

#[cfg(feature = "candle-cuda")]
pub mod candle_cuda;
