"""Elaboration and evaluation of a parsed Verilog netlist (verilog.py): flatten the instances, order
the bit-level drivers, refuse cycles, double drivers and undriven outputs, evaluate bit-sliced."""

from __future__ import annotations

import bisect
import dataclasses
from pathlib import Path

from ..errors import UserError
from . import bitslice as bs
from .tokens import MAX_HIERARCHY, MAX_INSTANCES, MAX_NET_BITS, MAX_WIDTH, Deadline
from .verilog import PRIMITIVES, Module, Net, builtin_cells, parse

OPERAND_BITS, PRODUCT_BITS = 8, 16


class Scope:
    def __init__(self, design: "Design", module: Module, prefix: str):
        self.design, self.module, self.prefix = design, module, prefix
        self.nets = {}
        for name, net in module.nets.items():
            self.nets[name] = design.allocate(dataclasses.replace(net), prefix)

    def net(self, name: str, line: int, implicit: bool = False) -> Net:
        n = self.nets.get(name)
        if n is None:
            if not implicit:
                raise UserError(f"{self.module.where}:{line}: {name!r} is not declared in module {self.module.name}")
            # an undeclared name connected to a port is an implicit 1-bit wire (Verilog's default_nettype)
            n = self.nets[name] = self.design.allocate(Net(name, 1, 0, 0, line=line), self.prefix)
        return n


@dataclasses.dataclass
class Stmt:
    targets: list      # global bit ids, least significant first
    expr: tuple
    scope: Scope
    line: int


class Design:
    def __init__(self, modules: dict, top: Module, where: str):
        self.modules, self.where = modules, where
        self.builtins = {k: v for k, v in builtin_cells().items() if k not in modules}
        self.nbits, self.bases, self.names = 0, [], []
        self.stmts: list[Stmt] = []
        self.check_size(top)
        self.top = self.elaborate(top, "", [top.name])
        self.inputs = [n for n in (self.top.nets[p] for p in top.ports) if n.direction == "input"]
        self.outputs = [n for n in (self.top.nets[p] for p in top.ports) if n.direction == "output"]

    # ------------------------------------------------------------ elaboration
    def check_size(self, top: Module) -> None:
        """Refuse, before building anything, a design whose flattening would exceed the limits: a tiny file
        of modules that each instantiate the one below twice flattens to millions of gates."""
        cost: dict = {}   # module name -> (net bits, instances, hierarchy levels) of one flattened copy
        stack = [(top, False)]
        while stack:
            m, done = stack.pop()
            if m.name in cost:
                continue
            subs = [(self.modules.get(c) or self.builtins.get(c)) for c, *_ in m.instances if c not in PRIMITIVES]
            subs = [x for x in subs if x is not None]   # unknown modules are named by elaborate()
            if not done:
                if len(stack) > MAX_HIERARCHY:
                    raise UserError(f"{m.where}:{m.line}: modules instantiate modules more than {MAX_HIERARCHY} "
                                    f"levels deep (or in a cycle), the limit of the circuit importer")
                stack.append((m, True))
                stack += [(x, False) for x in subs if x.name not in cost]
                continue
            if any(x.name not in cost for x in subs):   # a cycle: elaborate() names it
                cost[m.name] = (0, 0, 0)
                continue
            bits = sum(n.width for n in m.nets.values()) + sum(cost[x.name][0] for x in subs)
            insts = len(m.instances) + sum(cost[x.name][1] for x in subs)
            levels = 1 + max((cost[x.name][2] for x in subs), default=0)
            cost[m.name] = (min(bits, MAX_NET_BITS + 1), min(insts, MAX_INSTANCES + 1), levels)
        bits, insts, levels = cost[top.name]
        for have, limit, what in ((bits, MAX_NET_BITS, "net bits"), (insts, MAX_INSTANCES, "instances"),
                                  (levels, MAX_HIERARCHY, "levels of modules")):
            if have > limit:
                raise UserError(f"{self.where}: the flattened design has more than {limit:,} {what}, the limit of "
                                f"the circuit importer")

    def allocate(self, net: Net, prefix: str) -> Net:
        net.base = self.nbits
        self.nbits += net.width
        self.bases.append(net.base)
        self.names.append((prefix + net.name, net))
        return net

    def bit_name(self, bit: int) -> str:
        k = bisect.bisect_right(self.bases, bit) - 1
        name, net = self.names[k]
        if net.width == 1 and net.msb == net.lsb == 0:
            return name
        off = bit - net.base
        return f"{name}[{net.lsb + off if net.msb >= net.lsb else net.lsb - off}]"

    def bits(self, e, scope: Scope, where: str, implicit=False) -> list:
        """Global bit ids an identifier or select names, least significant first."""
        if e[0] == "id":
            n = scope.net(e[1], e[2], implicit)
            return list(range(n.base, n.base + n.width))
        _, name, hi, lo, line = e
        n = scope.net(name, line)
        step = 1 if hi >= lo else -1
        out = []
        for idx in range(lo, hi + step, step):
            off = n.offset(idx)
            if off is None:
                raise UserError(f"{where}:{line}: {name}[{idx}] is outside the declared range "
                                f"[{n.msb}:{n.lsb}] of {name}")
            out.append(n.base + off)
        return out

    def lvalue(self, e, scope: Scope, where: str, line: int, implicit=False) -> list:
        if e[0] in ("id", "part"):
            return self.bits(e, scope, where, implicit)
        if e[0] == "concat":
            out = []
            for part in reversed(e[1]):
                out += self.lvalue(part, scope, where, line)
            return out
        raise UserError(f"{where}:{line}: the left side of an assignment (or an output connection) must be a "
                        f"net, a bit or part select or a concatenation of them")

    def elaborate(self, module: Module, prefix: str, stack: list) -> Scope:
        scope, where = Scope(self, module, prefix), module.where
        for lhs, rhs, line in module.assigns:
            self.stmts.append(Stmt(self.lvalue(lhs, scope, where, line), rhs, scope, line))
        assigned = len(self.stmts)
        for cell, inst, conns, line in module.instances:
            if cell in PRIMITIVES:
                self.primitive(cell, inst, conns, scope, line)
                continue
            sub = self.modules.get(cell) or self.builtins.get(cell)
            if sub is None:
                raise UserError(f"{where}:{line}: unknown module {cell} (instance {inst}); it is neither defined "
                                f"in the file nor one of the built-in cells ({', '.join(sorted(builtin_cells()))})")
            if cell in stack:
                raise UserError(f"{where}:{line}: module {cell} instantiates itself")
            child = self.elaborate(sub, f"{prefix}{inst}.", stack + [cell])
            if isinstance(conns, list):
                if len(conns) != len(sub.ports):
                    raise UserError(f"{where}:{line}: instance {inst} of {cell} connects {len(conns)} ports; "
                                    f"{cell} has {len(sub.ports)} ({', '.join(sub.ports)})")
                conns = dict(zip(sub.ports, conns))
            unknown = [p for p in conns if p not in sub.ports]
            if unknown:
                raise UserError(f"{where}:{line}: {cell} has no port {unknown[0]} (instance {inst}; its ports: "
                                f"{', '.join(sub.ports)})")
            for port in sub.ports:
                e, net = conns.get(port), child.nets[port]
                if e is None:
                    continue
                if net.direction == "input":
                    w = self.size(e, scope, line, implicit=True)[0]
                    if w != net.width and not (e[0] == "num" and e[1] is None and e[2] < 1 << net.width):
                        raise UserError(f"{where}:{line}: port {port} of {cell} is {net.width} bit(s) wide, but "
                                        f"instance {inst} connects {w} bit(s) to it")
                    self.stmts.append(Stmt(list(range(net.base, net.base + net.width)), e, scope, line))
                else:
                    targets = self.lvalue(e, scope, where, line, implicit=True)
                    if len(targets) != net.width:
                        raise UserError(f"{where}:{line}: port {port} of {cell} is {net.width} bit(s) wide, but "
                                        f"instance {inst} connects {len(targets)} bit(s) to it")
                    self.stmts.append(Stmt(targets, ("id", port, line), child, line))
        # an undeclared name is an implicit wire only on a port; in an assignment it is a typo
        for st in self.stmts[assigned - len(module.assigns): assigned]:
            self.reads(st.expr, scope, implicit=False, line=st.line)
        return scope

    def primitive(self, gate, inst, conns, scope: Scope, line):
        where = scope.module.where
        if isinstance(conns, dict) or len(conns) < 2 or (PRIMITIVES[gate] is None and len(conns) != 2):
            raise UserError(f"{where}:{line}: gate {gate} {inst} needs positional terminals (output first)")
        out, ins = conns[0], conns[1:]
        for e in conns:
            if self.size(e, scope, line, implicit=True)[0] != 1:
                raise UserError(f"{where}:{line}: gate {gate} {inst} has a terminal wider than 1 bit")
        op = {"and": "&", "nand": "&", "or": "|", "nor": "|", "xor": "^", "xnor": "^"}.get(gate)
        expr = ins[0]
        for e in ins[1:]:
            expr = ("bin", op, expr, e)
        if gate in ("nand", "nor", "xnor", "not"):
            expr = ("un", "~", expr)
        self.stmts.append(Stmt(self.lvalue(out, scope, where, line, implicit=True), expr, scope, line))

    # ------------------------------------------------------------ expression sizes (Verilog rules)
    def size(self, e, scope: Scope, line, implicit=False) -> tuple[int, bool]:
        k = e[0]
        if k == "id":
            n = scope.net(e[1], e[2], implicit)
            return n.width, n.signed
        if k == "part":
            return abs(e[2] - e[3]) + 1, False
        if k == "num":
            return (e[1] or 32), e[3]
        if k == "concat":
            w = sum(self.size(p, scope, line)[0] for p in e[1])
            if w > MAX_WIDTH:
                raise UserError(f"{scope.module.where}:{line}: a concatenation of {w:,} bits; at most {MAX_WIDTH:,} "
                                f"are supported")
            return w, False
        if k == "un":
            return self.size(e[2], scope, line) if e[1] in ("~", "-", "+") else (1, False)
        if k == "bin":
            wa, sa = self.size(e[2], scope, line)
            if e[1] in ("<<", ">>", "<<<", ">>>"):
                return wa, sa
            wb, sb = self.size(e[3], scope, line)
            if e[1] in ("==", "!=", "<", ">", "<=", ">=", "&&", "||"):
                return 1, False
            return max(wa, wb), sa and sb
        wa, sa = self.size(e[2], scope, line)
        wb, sb = self.size(e[3], scope, line)
        return max(wa, wb), sa and sb

    def reads(self, e, scope: Scope, implicit=True, line=0) -> list:
        k = e[0]
        if k in ("id", "part"):
            return self.bits(e, scope, scope.module.where, implicit=implicit)
        if k == "num":
            return []
        if k == "concat":
            return [b for p in e[1] for b in self.reads(p, scope, implicit, line)]
        return [b for p in e[2:] if isinstance(p, tuple) for b in self.reads(p, scope, implicit, line)]

    # ------------------------------------------------------------ evaluation
    def ev(self, e, scope: Scope, width: int, signed: bool, values: list) -> list:
        k = e[0]
        if k in ("id", "part"):
            src = [values[b] for b in self.bits(e, scope, scope.module.where, implicit=True)]
            return bs.resize(src, width, signed and k == "id")
        if k == "num":
            return bs.resize(bs.const(e[2], e[1] or 32), width, signed)
        if k == "concat":
            out = []
            for p in reversed(e[1]):
                out += self.ev(p, scope, self.size(p, scope, 0)[0], False, values)
            return bs.resize(out, width, False)
        if k == "tern":
            w, s = self.size(e[1], scope, 0)
            cond = bs.any_bit(self.ev(e[1], scope, w, s, values))
            return bs.mux_word(cond, self.ev(e[2], scope, width, signed, values),
                               self.ev(e[3], scope, width, signed, values))
        if k == "un":
            op = e[1]
            if op in ("~", "-", "+"):
                v = self.ev(e[2], scope, width, signed, values)
                return bs.invert(v) if op == "~" else bs.neg(v) if op == "-" else v
            w, s = self.size(e[2], scope, 0)
            v = self.ev(e[2], scope, w, s, values)
            if op in ("!", "|", "~|"):
                r = bs.any_bit(v)
                r = bs.NOT(r) if op != "|" else r
            elif op in ("&", "~&"):
                r = bs.NOT(bs.any_bit(bs.invert(v)))
                r = bs.NOT(r) if op == "~&" else r
            else:
                r = 0
                for b in v:
                    r = bs.XOR(r, b)
                r = bs.NOT(r) if op != "^" else r
            return bs.resize([r], width, False)
        op, a, b = e[1], e[2], e[3]
        if op in ("<<", ">>", "<<<", ">>>"):
            wb, sb = self.size(b, scope, 0)
            k_ = bs.constant_value(self.ev(b, scope, wb, False, values))
            if k_ is None:
                raise UserError(f"{scope.module.where}: a shift by an amount that depends on the operands is "
                                f"outside the supported Verilog subset")
            v = self.ev(a, scope, width, signed, values)
            if op in ("<<", "<<<"):
                return bs.shift_left(v, min(k_, width))
            return bs.shift_right(v, min(k_, width), op == ">>>" and signed)
        if op in ("&&", "||"):
            ta = bs.any_bit(self.ev(a, scope, *self.size(a, scope, 0), values))
            tb = bs.any_bit(self.ev(b, scope, *self.size(b, scope, 0), values))
            return bs.resize([bs.AND(ta, tb) if op == "&&" else bs.OR(ta, tb)], width, False)
        if op in ("==", "!=", "<", ">", "<=", ">="):
            (wa, sa), (wb, sb) = self.size(a, scope, 0), self.size(b, scope, 0)
            w, s = max(wa, wb), sa and sb
            x, y = self.ev(a, scope, w, s, values), self.ev(b, scope, w, s, values)
            if op in ("==", "!="):
                r = bs.equal(x, y)
                r = r if op == "==" else bs.NOT(r)
            else:
                lt = {"<": (x, y), ">": (y, x), "<=": (y, x), ">=": (x, y)}[op]
                r = bs.less(*lt, s)
                r = r if op in ("<", ">") else bs.NOT(r)
            return bs.resize([r], width, False)
        x, y = self.ev(a, scope, width, signed, values), self.ev(b, scope, width, signed, values)
        if op == "+":
            return bs.add(x, y)
        if op == "-":
            return bs.sub(x, y)
        if op == "*":
            return bs.mul(x, y)
        fn = {"&": bs.AND, "|": bs.OR, "^": bs.XOR, "~^": bs.XOR, "^~": bs.XOR}[op]
        r = bs.bitwise(fn, x, y)
        return bs.invert(r) if op in ("~^", "^~") else r

    def schedule(self) -> list:
        """Statements the outputs depend on, each after the ones it reads; refuses double drivers, cycles
        and undriven bits the outputs depend on."""
        driver = [-1] * self.nbits
        for n in self.inputs:
            for b in range(n.base, n.base + n.width):
                driver[b] = -2
        for si, st in enumerate(self.stmts):
            for b in st.targets:
                if driver[b] == -2:
                    raise UserError(f"{st.scope.module.where}:{st.line}: drives the input {self.bit_name(b)}")
                if driver[b] >= 0:
                    other = self.stmts[driver[b]]
                    raise UserError(f"{st.scope.module.where}:{st.line}: {self.bit_name(b)} is driven twice "
                                    f"(also at {other.scope.module.where}:{other.line})")
                driver[b] = si
        deps_cache: dict = {}

        def deps(si, check):
            if si not in deps_cache:
                st = self.stmts[si]
                out = []
                for b in self.reads(st.expr, st.scope):
                    if driver[b] >= 0:
                        out.append(driver[b])
                    elif driver[b] == -1 and check:
                        raise UserError(f"{st.scope.module.where}:{st.line}: {self.bit_name(b)} is read but "
                                        f"nothing drives it")
                deps_cache[si] = out
            return deps_cache[si]

        color, order = [0] * len(self.stmts), []

        def visit(root, check):
            color[root] = 1
            stack = [(root, iter(deps(root, check)))]
            while stack:
                node, it = stack[-1]
                for d in it:
                    if color[d] == 0:
                        color[d] = 1
                        stack.append((d, iter(deps(d, check))))
                        break
                    if color[d] == 1:
                        st = self.stmts[d]
                        raise UserError(f"{st.scope.module.where}:{st.line}: combinational cycle through "
                                        f"{self.bit_name(st.targets[0])}")
                else:
                    color[node] = 2
                    if check:
                        order.append(node)
                    stack.pop()

        for n in self.outputs:
            for b in range(n.base, n.base + n.width):
                if driver[b] == -1:
                    raise UserError(f"{self.where}: output {self.bit_name(b)} is never driven")
                if driver[b] >= 0 and color[driver[b]] == 0:
                    visit(driver[b], True)
        for si in range(len(self.stmts)):
            if color[si] == 0:
                visit(si, False)
        return order

    def run(self, operands: dict) -> list:
        """Slices of the output for the given input slices ({input name: slices})."""
        order = self.schedule()
        deadline = Deadline(self.where)
        values = [None] * self.nbits
        for n in self.inputs:
            values[n.base: n.base + n.width] = bs.resize(operands[n.name], n.width, False)
        for si in order:
            deadline.check()
            st = self.stmts[si]
            w, s = self.size(st.expr, st.scope, st.line, implicit=True)
            v = self.ev(st.expr, st.scope, max(w, len(st.targets)), s, values)
            for b, x in zip(st.targets, v):
                values[b] = x
        out = self.outputs[0]
        return values[out.base: out.base + out.width]


def load(text: str, where: str) -> Design:
    """Parse, pick the top module (the one no other instantiates) and check its ports."""
    modules = parse(text, where)
    if not modules:
        raise UserError(f"{where}: no module found (empty or truncated file?)")
    used = {inst[0] for m in modules.values() for inst in m.instances}
    tops = [m for m in modules.values() if m.name not in used]
    if len(tops) != 1:
        stem = [m for m in tops if m.name == Path(where).name.split(".")[0]]
        if len(stem) != 1:
            raise UserError(f"{where}: cannot tell the top module: {', '.join(m.name for m in tops) or 'none'} "
                            f"{'are' if len(tops) > 1 else 'is'} instantiated by no other module")
        tops = stem
    top = tops[0]
    ins = [top.nets[p] for p in top.ports if top.nets[p].direction == "input"]
    outs = [top.nets[p] for p in top.ports if top.nets[p].direction == "output"]
    if len(ins) != 2 or len(outs) != 1:
        raise UserError(f"{where}:{top.line}: module {top.name} has {len(ins)} inputs and {len(outs)} outputs; "
                        f"a multiplier has two operand inputs and one product output")
    for n in ins:
        if n.width != OPERAND_BITS:
            raise UserError(f"{where}:{n.line}: input {n.name} of {top.name} is {n.width} bit(s) wide; an 8x8 "
                            f"multiplier's operands have 8 bits")
    if outs[0].width != PRODUCT_BITS:
        raise UserError(f"{where}:{outs[0].line}: output {outs[0].name} of {top.name} is {outs[0].width} bit(s) "
                        f"wide; an 8x8 multiplier's product has 16 bits")
    return Design(modules, top, where)
