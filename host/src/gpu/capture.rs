//! CUDA graphs: [`Gpu::capture`] records a stream's work into a [`Graph`], which replays it.

use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaGraph, DriverError};

use super::{ARENA_BYTES, Gpu};
use crate::error::{During, Error, Result};

impl Gpu {
    /// Records the work `f` queues into a CUDA graph instead of running it; replay it with
    /// [`Graph::replay`]. The buffers the work uses must outlive the graph and stay in place.
    /// While it records, this `Gpu` belongs to `f`: host copies and synchronizations are
    /// refused, and launches from other threads would join the graph.
    pub fn capture<E: From<Error>>(&self, f: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        // cuBLASLt's handle allocates its workspace when first used: create it before the
        // capture, or the graph would hold that allocation and refuse a second launch. Where
        // cuBLASLt is missing the capture goes on; a GEMM inside it reports that.
        let _ = self.blas();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if self.capturing.swap(true, Ordering::Relaxed) {
            return Err(Error::InCapture("a capture").into());
        }
        // Ends the capture and clears the flag however `f` leaves, a panic included.
        struct Recording<'a>(&'a Gpu);
        impl Recording<'_> {
            fn end(&self) -> Result<Option<CudaGraph>> {
                let graph = self.0.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                self.0.capturing.store(false, Ordering::Relaxed);
                graph.during("ending a graph capture")
            }
        }
        impl Drop for Recording<'_> {
            fn drop(&mut self) {
                if self.0.capturing.load(Ordering::Relaxed) {
                    let _ = self.end();
                }
            }
        }
        if let Ok(mut k) = self.captured.lock() {
            k.clear();
        }
        {
            let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
            if arena.0.is_none() {
                // SAFETY: the arena's contents are only ever scratch (see Gpu::scratch).
                arena.0 = Some(unsafe { self.stream.alloc(ARENA_BYTES) }.during("allocating device memory")?);
            }
            arena.1 = 0;
        }
        let recording = Recording(self);
        let begun = self.stream.begin_capture(mode).during("starting a graph capture");
        let queued = begun.map_err(E::from).and_then(|()| f());
        let graph = recording.end();
        queued?;
        let graph = graph?.ok_or(Error::Driver {
            during: "ending a graph capture (nothing was captured)",
            source: DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
        })?;
        graph.upload().during("uploading a graph")?;
        Ok(Graph(graph))
    }
}

/// A captured sequence of launches (see [`Gpu::capture`]).
pub struct Graph(CudaGraph);

impl Graph {
    /// Queues the whole graph on the stream it was captured from.
    pub fn replay(&self) -> Result<()> {
        self.0.launch().during("launching a graph")
    }
}
