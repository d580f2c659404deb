"""mslemu.gen: turn a .metal file into a C++ translation unit that runs its
kernels on the CPU through include/mslemu/metal_cpu_shim.h.

The .metal source itself is NOT edited.  The generator
  a) runs the C preprocessor over it (clang -E, <metal_stdlib> & co. stubbed
     out, __METAL_VERSION__ defined) so #if branches, macro-built signatures
     and macro template arguments are resolved exactly as the Metal compiler
     would see them;
  b) applies mechanical token-level rewrites that a header cannot express
     (line markers are kept, so diagnostics point to the original .metal):
       1. `threadgroup T name[N];` object declarations ->
          `auto &name = *mslemu::tg_var<T[N]>([]{}, "name");` (one instance per running
          threadgroup, shared by its fibers);
          `threadgroup` used as a pointer/reference qualifier is left to the
          shim, which erases it.
       2. half literals `1.0h` -> `1.0f16`.
       3. `[[host_name("x")]]` on explicit template instantiations is blanked
          (C++ forbids attributes there); the name is recorded for the launcher.
       4. `[[threadgroup(n)]]` -> `[[mslemu_threadgroup(n)]]` (the keyword macro
          would otherwise eat the attribute name).
       5. C-style casts to vector types `(half4) x` -> `mslemu::vcast<half4>()->* x`
          (in clang a C-style cast between ext vectors is a BITCAST, in MSL it
          converts values; ->* binds tighter than * / + so precedence is kept).
  c) writes a launcher (glue) that maps every kernel parameter to its
     attribute: [[buffer(i)]] (or the implicit in-order index), [[threadgroup(i)]],
     [[thread_position_in_grid]], ... a table of host names, a table of function
     constants, and the extern "C" entry points documented in include/mslemu/abi.h.

    python -m mslemu.gen KERNELS.metal OUTDIR [-DNAME=V ...] [-IDIR ...]
"""
import json
import os
import re
import subprocess
import sys

from .toolchain import INCLUDE_DIR, ROOT, STUB_DIR, define_flags, find_cxx  # noqa: F401 (re-exported)


class GenerateError(RuntimeError):
    """The .metal file cannot be turned into a launcher (preprocessing failed or a
    construct the generator does not understand)."""


BUILTINS = {
    "thread_position_in_grid": "tpig",
    "threadgroup_position_in_grid": "tgpig",
    "thread_position_in_threadgroup": "tpitg",
    "threads_per_threadgroup": "tptg",
    "dispatch_threads_per_threadgroup": "dtptg",
    "threadgroups_per_grid": "tgpg",
    "threads_per_grid": "tpg",
    "thread_index_in_threadgroup": "tiitg",
    "simdgroup_index_in_threadgroup": "sgitg",
    "thread_index_in_simdgroup": "tiisg",
    "simdgroups_per_threadgroup": "sgptg",
    "dispatch_simdgroups_per_threadgroup": "sgptg",
    "threads_per_simdgroup": "tpsg",
    "thread_execution_width": "tpsg",
}


def blank_comments_and_strings(src):
    """Same-length copy of src with comments and string/char literal bodies
    replaced by spaces (newlines kept), so regexes never match inside them."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if src[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if src[k] != "\n":
                    out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def match_paren(s, i, open_c="(", close_c=")"):
    depth = 0
    for j in range(i, len(s)):
        if s[j] == open_c:
            depth += 1
        elif s[j] == close_c:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced parentheses")


def split_top(s, sep=","):
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def parse_params(plist):
    params = []
    for p in split_top(plist):
        p = " ".join(p.split())
        if not p or p == "void":
            continue
        attrs = re.findall(r"\[\[(.*?)\]\]", p)
        decl = re.sub(r"\[\[.*?\]\]", " ", p).strip()
        params.append({"decl": decl, "attrs": [a.strip() for a in attrs]})
    return params


def param_expr(prm, kname, implicit_idx):
    decl = prm["decl"]
    if not prm["attrs"] and ("*" in decl or "&" in decl):
        # Metal assigns buffer indices to unattributed buffer arguments in order
        prm = dict(prm, attrs=["buffer(%d)" % implicit_idx])
    for a in prm["attrs"]:
        m = re.fullmatch(r"buffer\s*\(\s*(\d+)\s*\)", a)
        if m:
            idx = int(m.group(1))
            if "*" in decl:
                return "mslemu::glue::buf_ptr(%d)" % idx, ("buffer", idx)
            if "&" in decl:
                return "mslemu::glue::buf_ref(%d)" % idx, ("buffer", idx)
            raise GenerateError("%s: [[buffer]] parameter must be a pointer or reference: %s" % (kname, decl))
        m = re.fullmatch(r"threadgroup\s*\(\s*(\d+)\s*\)", a)
        if m:
            return "mslemu::glue::tg_ptr(%s)" % m.group(1), ("threadgroup", int(m.group(1)))
        if a in BUILTINS:
            return "mslemu::glue::%s()" % BUILTINS[a], ("builtin", a)
    raise GenerateError("%s: unsupported kernel parameter (need [[buffer(n)]], [[threadgroup(n)]] or a "
                     "thread-position attribute): %s %s" % (kname, decl, prm["attrs"]))


VEC_T = r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)[234]"
CAST_RE = re.compile(r"\(\s*(?:const\s+)?(" + VEC_T + r"|bfloat)\s*\)(?=\s*[\w(\-+!~*.])")
CAST_OK_WORDS = {"return", "case", "else", "do", "co_return", "throw"}
TG_DECL = re.compile(r"(?<![\w.])threadgroup(?=\s)")
HALF_LIT = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH](?!\w)")
# host_name("a" "b"): adjacent literals come from macros that stringize a type name
HOST_LITERALS = r"((?:\"[^\"]*\"\s*)+)"
HOST_NAME_INST = re.compile(r"\btemplate\s*(\[\[\s*host_name\s*\(\s*" + HOST_LITERALS + r"\)\s*\]\])")
FC_RE = re.compile(r"\bconstant\s+([\w:]+)\s+(\w+)\s*\[\[\s*function_constant\s*\(([^\]]+)\)\s*\]\]")


def type_alias_names(clean):
    """Names that may denote vector types through templates or typedefs:
    template type parameters, typedef and using-alias names."""
    names = set()
    for m in re.finditer(r"\btemplate\s*<", clean):
        try:
            e = match_paren(clean, m.end() - 1, "<", ">")
        except ValueError:
            continue
        for p in split_top(clean[m.end():e]):
            mm = re.match(r"\s*(?:typename|class)\s*(?:\.\.\.)?\s*(\w+)", p)
            if mm:
                names.add(mm.group(1))
    names |= set(re.findall(r"\btypedef\b[^;{}]*?\b(\w+)\s*;", clean))
    names |= set(re.findall(r"\busing\s+(\w+)\s*=", clean))
    return names - {"void", "auto"}


def namespace_scope_mask(clean):
    """For each character of `clean`: True where every enclosing brace is a namespace's
    (or an `extern "C"` block's), i.e. at program scope, and outside parentheses."""
    mask = [False] * len(clean)
    stack, paren = [], 0
    for i, ch in enumerate(clean):
        if ch == "{":
            head = clean[max(0, i - 200):i]
            stack.append(bool(re.search(r"(?:\bnamespace(?:\s+[\w:]+)?|\bextern\s*\"\s*\")\s*$", head)))
        elif ch == "}":
            if stack:
                stack.pop()
        elif ch == "(":
            paren += 1
        elif ch == ")":
            paren -= 1
        mask[i] = paren == 0 and all(stack)
    return mask


def program_scope_external_constants(clean):
    """Start offsets of program-scope declarations `constant T x = ...;` whose specifiers
    have none of static / const / constexpr / extern (and that are not function constants
    or templates): the declarations MSL gives external linkage."""
    mask = None
    out = []
    for m in re.finditer(r"(?<![\w.])constant(?!\w)", clean):
        if mask is None:
            mask = namespace_scope_mask(clean)
        if not mask[m.start()]:
            continue
        k = m.start() - 1
        while k >= 0 and clean[k] not in ";{}":
            k -= 1
        start = k + 1
        while True:  # past blanks and preprocessor line markers (`# 17 "x.h"`)
            while start < m.start() and clean[start] in " \t\r\n":
                start += 1
            if clean.startswith("#", start):
                start = clean.find("\n", start) + 1
                continue
            break
        end = clean.find(";", m.end())
        head = clean[start:m.start()] + clean[m.end():end if end >= 0 else len(clean)].split("=")[0]
        if re.search(r"\b(?:static|const|constexpr|extern|template|typedef|using)\b", head) or \
                "function_constant" in head or not re.match(r"\s*\w", clean[start:]):
            continue
        out.append(start)
    return out


def tg_declaration(body):
    """`float4 a[4][8], b` -> ['auto &a = *mslemu::tg_var<float4[4][8]>([]{}, "a");', ...]"""
    parts = split_top(body)
    m = re.match(r"\s*((?:const\s+|volatile\s+)*[\w:]+(?:\s*<[^;]*>)?)\s+(\w+)\s*((?:\[[^\]]*\]\s*)*)$", parts[0])
    if not m:
        return None
    ty = m.group(1)
    out = []
    for i, p in enumerate(parts):
        if i:
            m = re.match(r"\s*()(\w+)\s*((?:\[[^\]]*\]\s*)*)$", p)
            if not m:
                return None
        name, dims = m.group(2), "".join(m.group(3).split())
        # `auto &` (not `T (&x)[N]`): `half4 (` would trigger the half4(...) ctor macro
        out.append('auto &%s = *mslemu::tg_var<%s%s>([]{}, "%s");' % (name, ty, dims, name))
    return out


def rewrite(src, clean):
    """Return rewritten source (same length per line) + host-name attribute spans."""
    edits = []  # (start, end, replacement)
    aliases = type_alias_names(clean)
    # 1. threadgroup object declarations -> per-threadgroup storage references
    for m in TG_DECL.finditer(clean):
        # must start a statement
        k = m.start() - 1
        while k >= 0 and clean[k] in " \t\r\n":
            k -= 1
        if k >= 0 and clean[k] not in ";{}":
            continue
        end = clean.find(";", m.end())
        if end < 0:
            continue
        body = clean[m.end():end]
        if any(ch in re.sub(r"\[[^\]]*\]", "", body) for ch in "*&()=") or not body.strip():
            continue
        decls = tg_declaration(body)
        if decls is None:
            continue
        nl = src[m.start():end].count("\n")
        edits.append((m.start(), end, " ".join(decls)[:-1] + "\n" * nl))
    # 2. half literals
    for m in HALF_LIT.finditer(clean):
        edits.append((m.start(), m.end(), m.group(1) + "f16"))
    # 3. [[host_name("...")]] on explicit instantiations
    for m in HOST_NAME_INST.finditer(clean):
        s, e = m.span(1)
        edits.append((s, e, " " * (e - s)))
    # 4. [[threadgroup(n)]] would lose its name to the `threadgroup` keyword macro
    for m in re.finditer(r"\[\[\s*(threadgroup)\s*\(", clean):
        edits.append((m.start(1), m.end(1), "mslemu_threadgroup"))
    # 7. `constant T x [[function_constant(i)]];` -> mutable global (set by the launcher);
    #    `constant` is otherwise `const`.
    for m in FC_RE.finditer(clean):
        edits.append((m.start(), m.start() + len("constant"), " " * len("constant")))
    # 9. program-scope `constant T x[] = {...};` has EXTERNAL linkage in MSL (a clang C++
    #    frontend with address spaces: only `static`, `const` or `constexpr` make it internal),
    #    while the `constant` -> `const` macro alone would give C++'s internal linkage.  Keep
    #    MSL's rule, so linking several .metal files (mslemu.link) finds duplicate tables.
    for pos in program_scope_external_constants(clean):
        edits.append((pos, pos, "extern "))
    # 8. `#pragma unroll(expr)` / `#pragma clang loop ...`: perf hints whose argument
    #    may use names the Metal compiler never evaluates -> blank them.
    for m in re.finditer(r"^[ \t]*#[ \t]*pragma[ \t]+(?:unroll|nounroll|clang[ \t]+loop)\b[^\n]*", clean, re.M):
        edits.append((m.start(), m.end(), ""))
    # 5. C-style casts to vector types (and to bfloat, which clang refuses from int),
    #    also through template type parameters / typedef names: `(q4_t) x`
    cast_re = CAST_RE
    if aliases:
        cast_re = re.compile(r"\(\s*(?:const\s+)?(" + VEC_T + r"|bfloat|" + "|".join(
            re.escape(a) for a in sorted(aliases, key=len, reverse=True)) + r")\s*\)(?=\s*[\w(\-+!~*.])")
    for m in cast_re.finditer(clean):
        k = m.start() - 1
        while k >= 0 and clean[k] in " \t\r\n":
            k -= 1
        if k >= 0 and (clean[k].isalnum() or clean[k] == "_"):
            w = re.search(r"(\w+)$", clean[:k + 1]).group(1)
            if w not in CAST_OK_WORDS:
                continue  # sizeof(half4), f(half4), decltype(...)
        elif k >= 0 and clean[k] in ")]>":
            continue
        edits.append((m.start(), m.end(), "mslemu::vcast<%s>()->*" % m.group(1)))
    # 6. functional casts through template parameters / typedef names: `T4(x)`
    if aliases:
        fre = re.compile(r"(?<![\w.:>])(" + "|".join(re.escape(a) for a in sorted(aliases, key=len, reverse=True)) + r")\s*\(")
        for m in fre.finditer(clean):
            k = m.start() - 1
            while k >= 0 and clean[k] in " \t\r\n":
                k -= 1
            w = re.search(r"(\w+)$", clean[:k + 1]) if k >= 0 else None
            if w and w.group(1) in ("typedef", "struct", "class", "typename", "using", "operator", "sizeof", "alignof", "decltype"):
                continue
            if k >= 0 and clean[k] in "~":  # destructor
                continue
            edits.append((m.start(1), m.end(1), "mslemu::mk<%s>" % m.group(1)))
    edits.sort()
    out, pos = [], 0
    for s, e, r in edits:
        out.append(src[pos:s])
        out.append(r)
        pos = e
    out.append(src[pos:])
    return "".join(out)


KERNEL_RE = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*\]\])\s*(?:\[\[[^\]]*\]\]\s*)*void\s+(\w+)\s*\(")
INST_RE = re.compile(
    r"\btemplate\s*\[\[\s*host_name\s*\(\s*" + HOST_LITERALS + r"\)\s*\]\]\s*(?:\[\[[^\]]*\]\]\s*)*([^;]*);")


def parse_instantiation(decl):
    """`kernel decltype(f<float>) f<float>` / `kernel f_t f<half, 4>` /
    `kernel void f<float>(device float*, ...)` -> ("f", "float")"""
    decl = decl.strip()
    if decl.endswith(")"):  # full signature form: drop the parameter list
        depth = 0
        for j in range(len(decl) - 1, -1, -1):
            depth += decl[j] == ")"
            depth -= decl[j] == "("
            if depth == 0:
                decl = decl[:j].rstrip()
                break
    if not decl.endswith(">"):
        return None
    depth = 0
    for j in range(len(decl) - 1, -1, -1):
        depth += decl[j] == ">"
        depth -= decl[j] == "<"
        if depth == 0:
            m = re.search(r"(\w+)\s*$", decl[:j])
            return (m.group(1), " ".join(decl[j + 1:-1].split())) if m else None
    return None



PP_DEFINES = ["-D__METAL_VERSION__=310", "-D__METAL_EMULATED__=1", "-D__METAL_MACOS__=1"]


def preprocess(path, include_dirs=(), defines=(), cxx=None):
    """clang -E with the <metal_*> headers stubbed out (the real shim is
    included by the glue), so the MSL keywords survive as plain tokens."""
    cxx = cxx or find_cxx()
    cmd = [cxx, "-E", "-x", "c++", "-std=c++17", "-I", STUB_DIR, "-I", os.path.dirname(path)]
    for d in include_dirs:
        cmd += ["-I", os.fspath(d)]
    cmd += PP_DEFINES + define_flags(defines) + [path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise GenerateError("preprocessing failed:\n%s\n%s" % (" ".join(cmd), r.stderr))
    return r.stdout


def safe_eval_int(expr):
    expr = expr.strip()
    if not re.fullmatch(r"[0-9xXa-fA-F+\-*/%() <>|&uUlL]+", expr):
        raise GenerateError("cannot evaluate function_constant index: %s" % expr)
    py = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+", "", expr).replace("/", "//")  # C integer division
    try:
        return int(eval(py, {"__builtins__": {}}))  # digits and operators only (checked above)
    except Exception as e:  # noqa: BLE001 -- NameError for stray hex letters, SyntaxError, ...
        raise GenerateError("cannot evaluate function_constant index: %s (%s)" % (expr, e)) from None


def process_source(src, info):
    clean = blank_comments_and_strings(src)
    new = rewrite(src, clean)
    for m in KERNEL_RE.finditer(clean):
        name = m.group(1)
        lp = m.end() - 1
        rp = match_paren(clean, lp)
        params = parse_params(clean[lp + 1:rp])
        # template kernel?  look back for `template <...>` right before
        head = clean[max(0, m.start() - 2000):m.start()]
        is_tmpl = re.search(r"template\s*<[^;{}]*>\s*$", head) is not None
        info["functions"][name] = {"params": params, "template": is_tmpl}
        if not is_tmpl:
            info["kernels"][name] = {"call": name, "func": name}
    for m in INST_RE.finditer(clean):
        # strings are blanked in `clean`; concatenate the literals as C does
        host = "".join(re.findall(r'"([^"]*)"', src[m.start(1):m.end(1)]))
        parsed = parse_instantiation(m.group(2))
        if not parsed:
            raise GenerateError("cannot parse host_name instantiation: %s" % m.group(0))
        func, targs = parsed
        info["kernels"][host] = {"call": "%s<%s>" % (func, " ".join(targs.split())), "func": func}
    for m in FC_RE.finditer(clean):
        info["function_constants"].append({"type": m.group(1), "name": m.group(2),
                                           "index": str(safe_eval_int(m.group(3)))})
    return new


def generate(metal_path, outdir, include_dirs=(), defines=(), cxx=None):
    """Write OUTDIR/<name>.metal.ii (rewritten source), OUTDIR/glue.cpp (the TU to
    compile) and OUTDIR/kernels.json; return (glue path, {host name: bindings})."""
    metal_path = os.path.abspath(metal_path)
    info = {"kernels": {}, "functions": {}, "function_constants": []}
    outdir = os.path.abspath(outdir)
    os.makedirs(outdir, exist_ok=True)
    pp = preprocess(metal_path, include_dirs, defines, cxx)
    ii_name = os.path.basename(metal_path) + ".ii"
    with open(os.path.join(outdir, ii_name), "w", encoding="utf-8") as f:
        f.write(process_source(pp, info))
    lines = [
        "// generated by mslemu.gen -- do not edit",
        "#define MSLEMU_IMPLEMENTATION 1",
        "#include <mslemu/metal_cpu_shim.h>",
        '#include "%s"' % ii_name,  # relative: the build dir is renamed into the cache
        "#include <mslemu/end.h>",
        "",
        "namespace {",
    ]
    table = []
    meta = {}
    for i, (host, k) in enumerate(sorted(info["kernels"].items())):
        fn = info["functions"].get(k["func"])
        if fn is None:
            raise GenerateError("kernel %s: cannot find definition of %s" % (host, k["func"]))
        args, binds = [], []
        next_buf = 0
        for prm in fn["params"]:
            e, b = param_expr(prm, host, next_buf)
            if b[0] == "buffer":
                next_buf = b[1] + 1
            args.append(e)
            binds.append(b)
        lines.append("void mslemu_k%d() { %s(%s); }" % (i, k["call"], ", ".join(args)))
        table.append('  {"%s", &mslemu_k%d},' % (host, i))
        meta[host] = binds
    lines.append("const mslemu::KernelEntry kernel_table[] = {")
    lines += table
    lines.append("  {nullptr, nullptr}};")
    lines.append("const mslemu::FunctionConstantEntry fc_table[] = {")
    seen = set()
    for fc in info["function_constants"]:
        if fc["index"] in seen:
            raise GenerateError("function constant index %s is used twice" % fc["index"])
        seen.add(fc["index"])
        lines.append('  {"%s", (void *)&%s, sizeof(%s)},' % (fc["index"], fc["name"], fc["name"]))
    lines.append("  {nullptr, nullptr, 0}};")
    lines.append("}  // namespace")
    lines.append("")
    api = '__attribute__((visibility("default")))'
    lines += [
        'extern "C" {',
        "%s int mslemu_dispatch(const char *name, const mslemu_launch *L) {" % api,
        "  return mslemu::api_dispatch(kernel_table, fc_table, name, L, nullptr, 0);",
        "}",
        "%s int mslemu_dispatch_fc(const char *name, const mslemu_launch *L," % api,
        "                          const mslemu_function_constant *fc, uint32_t n_fc) {",
        "  return mslemu::api_dispatch(kernel_table, fc_table, name, L, fc, n_fc);",
        "}",
        "%s int mslemu_set_function_constant(const char *idx, const void *v, unsigned long n) {" % api,
        "  return mslemu::api_set_function_constant(fc_table, idx, v, n);",
        "}",
        "%s const char *mslemu_kernel_name(int i) { return mslemu::api_kernel_name(kernel_table, i); }" % api,
        "%s const char *mslemu_last_error(void) { return mslemu::last_error(); }" % api,
        "%s const mslemu_counts *mslemu_last_counts(void) { return mslemu::api_last_counts(); }" % api,
        '}  // extern "C"',
    ]
    glue = os.path.join(outdir, "glue.cpp")
    with open(glue, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(outdir, "kernels.json"), "w") as f:
        json.dump({"kernels": meta, "function_constants": info["function_constants"]}, f, indent=1)
    return glue, meta


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = [a for a in argv if not a.startswith(("-D", "-I"))]
    defs = [a for a in argv if a.startswith("-D")]
    incs = [a[2:] for a in argv if a.startswith("-I")]
    if len(args) != 2:
        print("usage: python -m mslemu.gen KERNELS.metal OUTDIR [-DNAME=V ...] [-IDIR ...]", file=sys.stderr)
        return 2
    try:
        g, meta = generate(args[0], args[1], incs, defs)
    except GenerateError as e:
        print("%s: %s" % (args[0], e), file=sys.stderr)
        return 1
    print(g)
    for k, v in meta.items():
        print("  kernel %s: %s" % (k, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
