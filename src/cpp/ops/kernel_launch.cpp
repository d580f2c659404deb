#include "ops/kernel_launch.h"

namespace vllm_metal {

namespace {
template <typename T>
FunctionConstant make_constant(int index, FunctionConstant::Type type, T v) {
  static_assert(sizeof(T) <= sizeof(uint32_t));
  FunctionConstant c;
  c.index = index;
  c.type = type;
  std::memcpy(&c.bits, &v, sizeof(T));
  return c;
}
}  // namespace

FunctionConstant FunctionConstant::boolean(int index, bool v) {
  return make_constant<uint8_t>(index, Type::kBool, v ? 1 : 0);
}
FunctionConstant FunctionConstant::int32(int index, int32_t v) {
  return make_constant(index, Type::kInt32, v);
}
FunctionConstant FunctionConstant::uint32(int index, uint32_t v) {
  return make_constant(index, Type::kUInt32, v);
}
FunctionConstant FunctionConstant::float32(int index, float v) {
  return make_constant(index, Type::kFloat32, v);
}

}  // namespace vllm_metal
