"""mslemu.link: .metal files compiled apart and linked into one library, like a metallib."""
import pytest

from mslemu import gen, link

HEADER = """#include <metal_stdlib>
using namespace metal;
"""


def write(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(HEADER + body)
    return str(p)


def kernel(name, table="tab"):
    return "kernel void %s(device int *o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = %s[i & 1]; }\n" % (
        name, table)


def test_program_scope_constant_table_in_two_files_is_a_duplicate_symbol(tmp_path):
    a = write(tmp_path, "a.metal", "constant int tab[2] = {1, 2};\n" + kernel("ka"))
    b = write(tmp_path, "b.metal", "constant int tab[2] = {1, 2};\n" + kernel("kb"))
    with pytest.raises(link.LinkError, match="multiple definition of `tab'"):
        link.link([a, b])


@pytest.mark.parametrize("decl", ["static constant int tab[2]", "constant constexpr int tab[2]",
                                  "constant const int tab[2]", "constexpr constant static int tab[2]"])
def test_internal_linkage_tables_link(tmp_path, decl):
    a = write(tmp_path, "a.metal", decl + " = {1, 2};\n" + kernel("ka"))
    b = write(tmp_path, "b.metal", decl + " = {1, 2};\n" + kernel("kb"))
    assert link.link([a, b]) == {a: ["ka"], b: ["kb"]}


def test_same_kernel_name_in_two_files_fails(tmp_path):
    a = write(tmp_path, "a.metal", "static constant int tab[2] = {1, 2};\n" + kernel("same"))
    b = write(tmp_path, "b.metal", "static constant int tab[2] = {1, 2};\n" + kernel("same"))
    with pytest.raises(link.LinkError, match="metal.kernel.same"):
        link.link([a, b])


def test_same_host_name_from_two_templates_fails(tmp_path):
    body = """template <class T> kernel void f(device T *o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = T(1); }
template [[host_name("fill_f32")]] kernel decltype(f<float>) f<float>;
"""
    a = write(tmp_path, "a.metal", body)
    b = write(tmp_path, "b.metal", body.replace("f<", "g<").replace("void f(", "void g("))
    with pytest.raises(link.LinkError, match="fill_f32"):
        link.link([a, b])


def test_only_external_program_scope_constants_are_marked():
    src = """namespace n { constant int a[2] = {1, 2}; }
constant int b = 3;
static constant int c = 4;
constant constexpr uint d = 5;
constant bool e [[function_constant(0)]];
struct S { int x; };
kernel void k(constant S &s [[buffer(0)]], device int *o [[buffer(1)]]) { constant int *p = &b; o[0] = *p; }
"""
    clean = gen.blank_comments_and_strings(src)
    marked = [src[p:p + 18].split("=")[0].strip() for p in gen.program_scope_external_constants(clean)]
    assert marked == ["constant int a[2]", "constant int b"]
