//! Code generation for the host CPU through LLVM's C API: the only FFI seam of the compiler.
//!
//! MLIR stops at the LLVM dialect; from there this module translates to LLVM IR, creates a
//! target machine for *this* processor (LLVM's own host CPU name and feature string), runs the
//! O3 pipeline (less the vectorisers and the loop unroller) and emits a position-independent object (and, on request, assembly). Doing this
//! ourselves rather than through MLIR's JIT gives explicit control of CPU, relocation model and
//! optimisation pipeline.

use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Once;

type LLVMTargetRef = *mut c_void;
type LLVMTargetMachineRef = *mut c_void;
type LLVMPassBuilderOptionsRef = *mut c_void;
type LLVMMemoryBufferRef = *mut c_void;
type LLVMModuleRef = *mut c_void;
type LLVMContextRef = *mut c_void;
type LLVMValueRef = *mut c_void;
type LLVMAttributeRef = *mut c_void;
type LLVMErrorRef = *mut c_void;

const CODEGEN_OPT_AGGRESSIVE: u32 = 3;
const RELOC_PIC: u32 = 2;
const CODE_MODEL_DEFAULT: u32 = 0;
const FILE_ASSEMBLY: u32 = 0;
const FILE_OBJECT: u32 = 1;
const FUNCTION_INDEX: u32 = !0;

unsafe extern "C" {
    fn LLVMGetDefaultTargetTriple() -> *mut c_char;
    fn LLVMGetHostCPUName() -> *mut c_char;
    fn LLVMGetHostCPUFeatures() -> *mut c_char;
    fn LLVMDisposeMessage(message: *mut c_char);
    fn LLVMGetTargetFromTriple(triple: *const c_char, target: *mut LLVMTargetRef, error: *mut *mut c_char) -> i32;
    fn LLVMCreateTargetMachine(
        target: LLVMTargetRef,
        triple: *const c_char,
        cpu: *const c_char,
        features: *const c_char,
        level: u32,
        reloc: u32,
        code_model: u32,
    ) -> LLVMTargetMachineRef;
    fn LLVMDisposeTargetMachine(tm: LLVMTargetMachineRef);
    fn LLVMCreateTargetDataLayout(tm: LLVMTargetMachineRef) -> *mut c_void;
    fn LLVMSetModuleDataLayout(module: LLVMModuleRef, layout: *mut c_void);
    fn LLVMDisposeTargetData(layout: *mut c_void);
    fn LLVMSetTarget(module: LLVMModuleRef, triple: *const c_char);
    fn LLVMCreatePassBuilderOptions() -> LLVMPassBuilderOptionsRef;
    fn LLVMDisposePassBuilderOptions(options: LLVMPassBuilderOptionsRef);
    fn LLVMPassBuilderOptionsSetLoopVectorization(options: LLVMPassBuilderOptionsRef, on: i32);
    fn LLVMPassBuilderOptionsSetSLPVectorization(options: LLVMPassBuilderOptionsRef, on: i32);
    fn LLVMPassBuilderOptionsSetLoopUnrolling(options: LLVMPassBuilderOptionsRef, on: i32);
    fn LLVMRunPasses(
        module: LLVMModuleRef,
        passes: *const c_char,
        tm: LLVMTargetMachineRef,
        options: LLVMPassBuilderOptionsRef,
    ) -> LLVMErrorRef;
    fn LLVMGetErrorMessage(error: LLVMErrorRef) -> *mut c_char;
    fn LLVMDisposeErrorMessage(message: *mut c_char);
    fn LLVMTargetMachineEmitToMemoryBuffer(
        tm: LLVMTargetMachineRef,
        module: LLVMModuleRef,
        file_type: u32,
        error: *mut *mut c_char,
        out: *mut LLVMMemoryBufferRef,
    ) -> i32;
    fn LLVMGetBufferStart(buffer: LLVMMemoryBufferRef) -> *const c_char;
    fn LLVMGetBufferSize(buffer: LLVMMemoryBufferRef) -> usize;
    fn LLVMDisposeMemoryBuffer(buffer: LLVMMemoryBufferRef);
    fn LLVMContextCreate() -> LLVMContextRef;
    fn LLVMContextDispose(context: LLVMContextRef);
    fn LLVMDisposeModule(module: LLVMModuleRef);
    fn LLVMGetFirstFunction(module: LLVMModuleRef) -> LLVMValueRef;
    fn LLVMGetNextFunction(function: LLVMValueRef) -> LLVMValueRef;
    fn LLVMCreateStringAttribute(
        context: LLVMContextRef,
        key: *const c_char,
        key_len: u32,
        value: *const c_char,
        value_len: u32,
    ) -> LLVMAttributeRef;
    fn LLVMAddAttributeAtIndex(function: LLVMValueRef, index: u32, attribute: LLVMAttributeRef);
    fn LLVMIsDeclaration(global: LLVMValueRef) -> i32;
}

#[cfg(target_arch = "x86_64")]
unsafe extern "C" {
    fn LLVMInitializeX86TargetInfo();
    fn LLVMInitializeX86Target();
    fn LLVMInitializeX86TargetMC();
    fn LLVMInitializeX86AsmPrinter();
}

#[cfg(target_arch = "aarch64")]
unsafe extern "C" {
    fn LLVMInitializeAArch64TargetInfo();
    fn LLVMInitializeAArch64Target();
    fn LLVMInitializeAArch64TargetMC();
    fn LLVMInitializeAArch64AsmPrinter();
}

static INIT: Once = Once::new();

fn init_native_target() {
    INIT.call_once(|| {
        // SAFETY: LLVM's target registration functions take no arguments and are idempotent;
        // `Once` runs them exactly once before any target lookup.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            {
                LLVMInitializeX86TargetInfo();
                LLVMInitializeX86Target();
                LLVMInitializeX86TargetMC();
                LLVMInitializeX86AsmPrinter();
            }
            #[cfg(target_arch = "aarch64")]
            {
                LLVMInitializeAArch64TargetInfo();
                LLVMInitializeAArch64Target();
                LLVMInitializeAArch64TargetMC();
                LLVMInitializeAArch64AsmPrinter();
            }
        }
    });
}

/// Takes ownership of an LLVM-allocated message and returns it as a String.
fn take_message(ptr: *mut c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: `ptr` is a NUL-terminated string allocated by LLVM, released here exactly once.
    unsafe {
        let s = CStr::from_ptr(ptr).to_string_lossy().into_owned();
        LLVMDisposeMessage(ptr);
        s
    }
}

/// LLVM's view of the host: target triple, CPU name and feature string.
#[derive(Clone, Debug)]
pub struct HostTarget {
    pub triple: String,
    pub cpu: String,
    pub features: String,
}

impl HostTarget {
    pub fn detect() -> HostTarget {
        init_native_target();
        // SAFETY: these return newly allocated strings that `take_message` frees.
        let (triple, cpu, features) = unsafe {
            (
                LLVMGetDefaultTargetTriple(),
                LLVMGetHostCPUName(),
                LLVMGetHostCPUFeatures(),
            )
        };
        HostTarget {
            triple: take_message(triple),
            cpu: take_message(cpu),
            features: take_message(features),
        }
    }

    /// The host, or the x86-64 level `options.target_cpu` names (its features are those the
    /// level's CPU name implies, none of the host's beyond them).
    pub fn for_options(options: &kiln_core::CompileOptions) -> HostTarget {
        let host = Self::detect();
        match &options.target_cpu {
            Some(cpu) => HostTarget {
                cpu: cpu.clone(),
                features: String::new(),
                ..host
            },
            None => host,
        }
    }
}

/// Output of generating code for one module.
pub struct CodegenOutput {
    pub object: Vec<u8>,
    pub assembly: Option<String>,
}

/// A target machine for the host, owned by one thread (LLVM target machines are not shared).
pub struct TargetMachine {
    tm: LLVMTargetMachineRef,
    triple: CString,
    /// Widest vector in bits the kernels use; passed to LLVM so explicit 512-bit vectors are
    /// kept whole on CPUs whose tuning otherwise prefers 256-bit code.
    vector_bits: usize,
}

impl TargetMachine {
    pub fn new(host: &HostTarget, vector_bits: usize) -> Result<TargetMachine, String> {
        init_native_target();
        let triple = CString::new(host.triple.clone()).map_err(|e| e.to_string())?;
        let cpu = CString::new(host.cpu.clone()).map_err(|e| e.to_string())?;
        let features = CString::new(host.features.clone()).map_err(|e| e.to_string())?;
        let mut target = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: valid C strings and out-pointers; on failure `err` holds an LLVM message.
        let failed = unsafe { LLVMGetTargetFromTriple(triple.as_ptr(), &mut target, &mut err) };
        if failed != 0 {
            return Err(format!("LLVM has no target for {}: {}", host.triple, take_message(err)));
        }
        // SAFETY: `target` was returned by LLVM for this triple; the strings outlive the call.
        let tm = unsafe {
            LLVMCreateTargetMachine(
                target,
                triple.as_ptr(),
                cpu.as_ptr(),
                features.as_ptr(),
                CODEGEN_OPT_AGGRESSIVE,
                RELOC_PIC,
                CODE_MODEL_DEFAULT,
            )
        };
        if tm.is_null() {
            return Err(format!(
                "LLVM could not create a target machine for {} ({})",
                host.triple, host.cpu
            ));
        }
        Ok(TargetMachine {
            tm,
            triple,
            vector_bits,
        })
    }

    /// Translates an MLIR module (already in the LLVM dialect) to LLVM IR, optimises it at O3
    /// (without LLVM's own vectorisers and loop unrolling) and emits an object file.
    pub fn compile(&self, module: &melior::ir::Module, want_asm: bool) -> Result<CodegenOutput, String> {
        // SAFETY: the LLVM context and module are created and disposed in this function; the
        // MLIR operation is valid for the duration of the translation call.
        unsafe {
            let ctx = LLVMContextCreate();
            let llmod =
                mlir_sys::mlirTranslateModuleToLLVMIR(module.as_operation().to_raw(), ctx as _) as LLVMModuleRef;
            if llmod.is_null() {
                LLVMContextDispose(ctx);
                return Err("translation from the MLIR LLVM dialect to LLVM IR failed".into());
            }
            let result = self.optimise_and_emit(ctx, llmod, want_asm);
            LLVMDisposeModule(llmod);
            LLVMContextDispose(ctx);
            result
        }
    }

    /// # Safety
    /// `ctx` and `llmod` must be a live LLVM context and a module created in it.
    unsafe fn optimise_and_emit(
        &self,
        ctx: LLVMContextRef,
        llmod: LLVMModuleRef,
        want_asm: bool,
    ) -> Result<CodegenOutput, String> {
        // SAFETY: (whole body) all handles are live per the function contract; every buffer and
        // message LLVM returns is released before returning.
        unsafe {
            LLVMSetTarget(llmod, self.triple.as_ptr());
            let layout = LLVMCreateTargetDataLayout(self.tm);
            LLVMSetModuleDataLayout(llmod, layout);
            LLVMDisposeTargetData(layout);
            self.set_vector_width(ctx, llmod);
            let options = LLVMCreatePassBuilderOptions();
            // The kernels arrive vectorised and unrolled as they are meant to run: LLVM's loop
            // and SLP vectorisers and its loop unroller only cost-model and copy them again.
            // Without those three, a cold compile of the Qwen2.5-0.5B-shape Q4_K_M GGUF (23
            // kernels) took 3.8-4.6 s instead of 5.4-6.3 s on a 2-vCPU AMD EPYC (Zen 5 class),
            // the bf16 folder 1.24 s instead of 1.76 s, the 135M Q4_1 demo 1.67 s instead of
            // 2.46 s, with prefill and decode as fast as before (`kiln bench`, native and
            // x86-64-v3 code, libraries interleaved, within the machine's noise).
            LLVMPassBuilderOptionsSetLoopVectorization(options, 0);
            LLVMPassBuilderOptionsSetSLPVectorization(options, 0);
            LLVMPassBuilderOptionsSetLoopUnrolling(options, 0);
            let pipeline = CString::new("default<O3>").expect("static string");
            let err = LLVMRunPasses(llmod, pipeline.as_ptr(), self.tm, options);
            LLVMDisposePassBuilderOptions(options);
            if !err.is_null() {
                let msg = LLVMGetErrorMessage(err);
                let text = CStr::from_ptr(msg).to_string_lossy().into_owned();
                LLVMDisposeErrorMessage(msg);
                return Err(format!("LLVM optimisation failed: {text}"));
            }
            let object = self.emit(llmod, FILE_OBJECT)?;
            let assembly = if want_asm {
                Some(String::from_utf8_lossy(&self.emit(llmod, FILE_ASSEMBLY)?).into_owned())
            } else {
                None
            };
            Ok(CodegenOutput { object, assembly })
        }
    }

    /// # Safety
    /// `llmod` must be a live module.
    unsafe fn emit(&self, llmod: LLVMModuleRef, file_type: u32) -> Result<Vec<u8>, String> {
        let mut err = std::ptr::null_mut();
        let mut buffer = std::ptr::null_mut();
        // SAFETY: live target machine and module; the buffer is copied then disposed.
        unsafe {
            if LLVMTargetMachineEmitToMemoryBuffer(self.tm, llmod, file_type, &mut err, &mut buffer) != 0 {
                return Err(format!("LLVM code generation failed: {}", take_message(err)));
            }
            let bytes =
                std::slice::from_raw_parts(LLVMGetBufferStart(buffer) as *const u8, LLVMGetBufferSize(buffer)).to_vec();
            LLVMDisposeMemoryBuffer(buffer);
            Ok(bytes)
        }
    }

    /// Marks every defined function with the vector width the kernels were written for.
    ///
    /// # Safety
    /// `ctx` and `llmod` must be live.
    unsafe fn set_vector_width(&self, ctx: LLVMContextRef, llmod: LLVMModuleRef) {
        let width = self.vector_bits.to_string();
        let attrs = [
            ("min-legal-vector-width", width.as_str()),
            ("prefer-vector-width", width.as_str()),
        ];
        // SAFETY: iterating the module's function list and attaching string attributes created
        // in the module's own context.
        unsafe {
            let mut f = LLVMGetFirstFunction(llmod);
            while !f.is_null() {
                if LLVMIsDeclaration(f) == 0 {
                    for (k, v) in attrs {
                        let a = LLVMCreateStringAttribute(
                            ctx,
                            k.as_ptr() as _,
                            k.len() as u32,
                            v.as_ptr() as _,
                            v.len() as u32,
                        );
                        LLVMAddAttributeAtIndex(f, FUNCTION_INDEX, a);
                    }
                }
                f = LLVMGetNextFunction(f);
            }
        }
    }
}

impl Drop for TargetMachine {
    fn drop(&mut self) {
        // SAFETY: `tm` was created by LLVMCreateTargetMachine and is disposed once.
        unsafe { LLVMDisposeTargetMachine(self.tm) }
    }
}
