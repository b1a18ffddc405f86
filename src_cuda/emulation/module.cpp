// The emulation extension, minipaged_ops._emu: torch.ops.minipaged_emu.* are the CUDA ops of
// torch.ops.minipaged (same schemas, same bindings, same kernel source) running on CPU tensors
// through the host emulation of cuda_emu.h. Tests use it as a third device, "emu".
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <torch/library.h>

#include <string>

// The schemas are copied from the minipaged namespace (defined once, in registration.cpp), so a
// new op needs no change here; minipaged_ops imports _C before this module.
TORCH_LIBRARY(minipaged_emu, m) {
  const std::string from = "minipaged::", to = "minipaged_emu::";
  bool found = false;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind(from, 0) != 0) continue;
    const c10::FunctionSchema& schema = c10::Dispatcher::singleton().findSchemaOrThrow(name.name.c_str(), "").schema();
    m.def(schema.cloneWithName(to + name.name.substr(from.size()), name.overload_name));
    found = true;
  }
  TORCH_CHECK(found, "minipaged_emu: torch.ops.minipaged is not loaded; import minipaged_ops first");
}

TORCH_LIBRARY_IMPL(minipaged_emu, CatchAll, m) {
  m.impl("build_info", [] { return std::string(MINIPAGED_EMULATION_INFO); });
}

extern "C" PyMODINIT_FUNC PyInit__emu(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_emu", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
