//! `wisp:llm/gpu` without a device, as `wit/gpu.wit` asks of any host that has none: `available`
//! is `none` and every other call is `unavailable`, so the guest runs on its CPU kernels.

use alloc::vec::Vec;

use crate::bindings::exports::wisp::llm::gpu::{
    self, DeviceInfo, Error, KvCache, Op, Output, Program, Sequence, Weight, WeightBorrow, WeightFormat,
};
use crate::{Never, Virt};

/// The answer to every call that would need device memory.
fn unavailable() -> Error {
    let why = "no GPU in this component (wisp bake); the guest runs on its CPU path";
    Error::Unavailable(why.into())
}

/// No device: no call succeeds, so no `weight`, `kv-cache` or `program` is ever made.
impl gpu::Guest for Virt {
    type Weight = Never;
    type KvCache = Never;
    type Program = Never;

    fn create_program(_: Vec<WeightBorrow<'_>>, _: u32, _: Vec<Op>) -> Result<Program, Error> {
        Err(unavailable())
    }

    fn available() -> Option<DeviceInfo> {
        None
    }

    fn upload(_: WeightFormat, _: u32, _: u32, _: Vec<u8>, _: Vec<f32>) -> Result<Weight, Error> {
        Err(unavailable())
    }

    fn allocate(_: WeightFormat, _: u32, _: u32) -> Result<Weight, Error> {
        Err(unavailable())
    }

    fn create_kv_cache(_: u32, _: u32) -> Result<KvCache, Error> {
        Err(unavailable())
    }
}

/// A weight on the device, of which there is none.
impl gpu::GuestWeight for Never {
    fn write_rows(&self, _: u32, _: Vec<u8>, _: Vec<f32>) -> Result<(), Error> {
        match *self {}
    }

    fn rows(&self) -> u32 {
        match *self {}
    }

    fn cols(&self) -> u32 {
        match *self {}
    }

    fn format(&self) -> WeightFormat {
        match *self {}
    }
}

/// A key/value cache on the device, of which there is none.
impl gpu::GuestKvCache for Never {
    fn slots(&self) -> u32 {
        match *self {}
    }

    fn width(&self) -> u32 {
        match *self {}
    }
}

/// A program on the device, of which there is none.
impl gpu::GuestProgram for Never {
    fn run(&self, _: Vec<Vec<f32>>, _: Vec<Sequence<'_>>) -> Result<Vec<Output>, Error> {
        match *self {}
    }

    fn ops(&self) -> u32 {
        match *self {}
    }
}
