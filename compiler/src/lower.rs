//! The MLIR pass pipeline from the emitted dialects (scf, arith, math, vector, memref, func) down
//! to the LLVM dialect.

use melior::{Context, ir::Module, pass::PassManager};

/// Version of the lowering pipeline and emitters; bump whenever either changes the generated
/// code, so stale libraries are not reused from the cache.
pub const PIPELINE_VERSION: u32 = 7;

/// The pipeline, in MLIR's textual form. `use-bare-ptr-memref-call-conv` turns each statically
/// shaped memref argument into one pointer, which is the ABI the runtime calls.
pub const PIPELINE: &str = "builtin.module(\
    canonicalize, cse, \
    arith-expand, \
    convert-vector-to-scf, \
    convert-scf-to-cf, \
    convert-vector-to-llvm, \
    convert-math-to-llvm, \
    expand-strided-metadata, \
    finalize-memref-to-llvm, \
    convert-arith-to-llvm, \
    convert-index-to-llvm, \
    convert-cf-to-llvm, \
    convert-func-to-llvm{use-bare-ptr-memref-call-conv=1}, \
    reconcile-unrealized-casts)";

/// Lowers `module` in place to the LLVM dialect.
pub fn lower_to_llvm(ctx: &Context, module: &mut Module) -> Result<(), String> {
    let pm = PassManager::new(ctx);
    // The emitted module is verified before lowering (`compile_one`), and a broken result
    // fails translation to LLVM IR with an error; verifying after each of the 14 passes as
    // well was 0.7 s of the 7 s of CPU a cold compile of the 0.5B Q4_K_M GGUF took.
    pm.enable_verifier(false);
    melior::utility::parse_pass_pipeline(pm.as_operation_pass_manager(), PIPELINE)
        .map_err(|e| format!("invalid pass pipeline: {e}"))?;
    pm.run(module)
        .map_err(|e| format!("lowering to the LLVM dialect failed: {e}"))
}
