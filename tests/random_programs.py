"""Random training programs for the memory tests: :func:`generate` writes the source of a model of 1-4 segments.

Each segment is an ``nn.Module`` of random ops over earlier values: linears and convolutions, activations, views,
slices and reshapes, ``split``/``chunk``/``unbind`` and their items, ``cat``/``stack``, in-place writes (into
fresh values, existing ones and slices of them), matmuls and attention (SDPA), reductions; a loss or none, and
extra outputs (views, detached ones). ``make()`` in the source returns the model and its inputs. The segments are
what the tests pin to devices. The same seed gives the same source.
"""

import random

WIDTHS = [32, 48, 64, 96, 128]


class G:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.seed = seed
        self.vals = {}  # name -> shape tuple
        self.contig = {}
        self.nv = 0
        self.nl = 0
        self.ops = []  # (lines, ins, outs, layers)
        self.noinplace = set()  # names we must not mutate (inputs)

    def new(self, shape, contig=True, src=None):
        n = f"v{self.nv}"
        if src is not None and src in self.noinplace:
            self.noinplace.add(n)
        self.nv += 1
        self.vals[n] = tuple(shape)
        self.contig[n] = contig
        return n

    def layer(self, ctor):
        n = f"l{self.nl}"
        self.nl += 1
        return n, ctor

    def pick(self, pred=lambda s: True, recent=True):
        c = [n for n, s in self.vals.items() if pred(s)]
        if not c:
            return None
        if recent and self.r.random() < 0.6:
            c = c[-4:]
        return self.r.choice(c)

    def emit(self, lines, ins, outs, layers=()):
        self.ops.append((lines, list(ins), list(outs), list(layers)))

    # ---- op makers ----
    def op_linear(self):
        x = self.pick(lambda s: len(s) >= 2)
        s = self.vals[x]
        w2 = self.r.choice(WIDTHS)
        ln, ctor = self.layer(f"nn.Linear({s[-1]}, {w2}, bias={self.r.random() < 0.8})")
        y = self.new(s[:-1] + (w2,))
        self.emit([f"{y} = self.{ln}({x})"], [x], [y], [(ln, ctor)])

    def op_act(self):
        x = self.pick()
        s = self.vals[x]
        f = self.r.choice(
            [
                "torch.relu({})",
                "F.gelu({})",
                "torch.tanh({})",
                "F.silu({})",
                "torch.sigmoid({})",
                "torch.softmax({}, dim=-1)",
                "F.layer_norm({0}, ({0}.shape[-1],))",
                "({} * 0.5)",
                "torch.exp({})",
                "F.dropout({}, 0.1, self.training)",
            ]
        )
        y = self.new(s, True)
        self.emit([f"{y} = " + f.format(x)], [x], [y])

    def op_inplace_fresh(self):
        x = self.pick()
        s = self.vals[x]
        y = self.new(s, True)
        base = self.r.choice([f"{x} * 1.5", f"{x} + 1.0", f"torch.tanh({x})", f"{x}.clone()"])
        post = self.r.choice(["relu_()", "mul_(0.5)", "add_(1.0)", "sigmoid_()", "tanh_()"])
        lines = [f"{y} = {base}", f"{y}.{post}"]
        ins = [x]
        z = self.pick(lambda t: t == s)
        if z is not None and self.r.random() < 0.5:
            lines.append(f"{y}.add_({z})")
            ins.append(z)
        self.emit(lines, ins, [y])

    def op_inplace_existing(self):
        # mutate an existing non-input value in place; also on a partial view
        c = [n for n in self.vals if n not in self.noinplace]
        if not c:
            return
        x = self.r.choice(c[-3:])
        s = self.vals[x]
        y = self.new(s, self.contig[x])
        if self.r.random() < 0.5 and s[-1] >= 16:
            a = self.r.randrange(0, s[-1] // 2)
            b = self.r.randrange(a + 4, s[-1] + 1)
            post = self.r.choice(["mul_(2.0)", "relu_()", "add_(0.5)"])
            self.emit([f"{x}[..., {a}:{b}].{post}", f"{y} = {x}"], [x], [y])
        else:
            post = self.r.choice(["relu_()", "mul_(0.5)", "add_(1.0)"])
            self.emit([f"{y} = {x}.{post}"], [x], [y])

    def op_binary(self):
        a = self.pick()
        s = self.vals[a]
        b = self.pick(lambda t: t == s, recent=False)
        f = self.r.choice(["{} + {}", "{} * {}", "{} - {}", "torch.maximum({}, {})"])
        y = self.new(s)
        self.emit([f"{y} = " + f.format(a, b)], [a, b], [y])

    def op_addcmul(self):
        a = self.pick()
        s = self.vals[a]
        b = self.pick(lambda t: t == s, recent=False)
        c = self.pick(lambda t: t == s, recent=False)
        y = self.new(s)
        f = self.r.choice(
            [
                f"torch.addcmul({a}, {b}, {c}, value=0.5)",
                f"torch.addcdiv({a}, {b}, {c}.abs() + 1.0)",
                f"torch.lerp({a}, {b}, 0.3)",
                f"torch.where({c} > 0, {a}, {b})",
            ]
        )
        self.emit([f"{y} = {f}"], [a, b, c], [y])

    def op_view(self):
        x = self.pick(lambda s: len(s) >= 2)
        s = self.vals[x]
        k = self.r.randrange(7)
        if k == 0 and len(s) >= 2:
            y = self.new(s[:-2] + (s[-1], s[-2]), False, src=x)
            self.emit([f"{y} = {x}.transpose(-1, -2)"], [x], [y])
        elif k == 1 and len(s) >= 3:
            y = self.new(s[:-2] + (s[-2] * s[-1],), self.contig[x])
            m = "view" if self.contig[x] else "reshape"
            self.emit([f"{y} = {x}.{m}({', '.join(map(str, s[:-2]))}, -1)"], [x], [y])
        elif k == 2 and len(s) == 3:
            y = self.new((s[0], s[2], s[1]), False, src=x)
            self.emit([f"{y} = {x}.permute(0, 2, 1)"], [x], [y])
        elif k == 3 and s[-1] >= 8:
            a = self.r.randrange(0, s[-1] // 2)
            b = self.r.randrange(a + 4, s[-1] + 1)
            y = self.new(s[:-1] + (b - a,), False, src=x)
            self.emit([f"{y} = {x}[..., {a}:{b}]"], [x], [y])
        elif k == 4 and len(s) >= 3:
            i = self.r.randrange(s[1])
            y = self.new((s[0],) + s[2:], False, src=x)
            self.emit([f"{y} = {x}[:, {i}]"], [x], [y])
        elif k == 5:
            d = self.r.randrange(1, len(s))
            if s[d] < 2:
                return
            st = self.r.randrange(0, s[d] // 2)
            ln = self.r.randrange(1, s[d] - st + 1)
            y = self.new(s[:d] + (ln,) + s[d + 1 :], False, src=x)
            self.emit([f"{y} = {x}.narrow({d}, {st}, {ln})"], [x], [y])
        elif k == 6 and len(s) == 2 and s[-1] % 8 == 0:
            y = self.new((s[0], 8, s[1] // 8), self.contig[x])
            m = "view" if self.contig[x] else "reshape"
            self.emit([f"{y} = {x}.{m}({s[0]}, 8, {s[1] // 8})"], [x], [y])
        elif len(s) >= 1 and s[0] > 1 and self.r.random() < 0.3:
            # select on batch: h[i]
            i = self.r.randrange(s[0])
            y = self.new(s[1:], False, src=x)
            self.emit([f"{y} = {x}[{i}]"], [x], [y])

    def op_tuple(self):
        x = self.pick(lambda s: len(s) >= 2)
        s = self.vals[x]
        k = self.r.randrange(3)
        d = self.r.randrange(1, len(s)) if self.r.random() < 0.5 else len(s) - 1
        n = s[d]
        if k == 0 and n >= 4:
            sz = self.r.randrange(1, n // 2 + 1)
            pieces = [sz] * (n // sz) + ([n % sz] if n % sz else [])
            call = f"torch.split({x}, {sz}, dim={d})"
        elif k == 1 and n >= 2:
            c = self.r.randrange(2, min(n, 4) + 1)
            q = -(-n // c)
            pieces = [q] * (n // q) + ([n % q] if n % q else [])
            call = f"torch.chunk({x}, {c}, dim={d})"
        elif k == 2 and n <= 16:
            pieces = [None] * n
            call = f"torch.unbind({x}, dim={d})"
        else:
            return
        t = f"t{self.nv}"
        self.nv += 1
        lines = [f"{t} = {call}"]
        outs = []
        used = self.r.sample(range(len(pieces)), min(len(pieces), self.r.randrange(1, 4)))
        for i in sorted(used):
            p = pieces[i]
            sh = s[:d] + s[d + 1 :] if p is None else s[:d] + (p,) + s[d + 1 :]
            y = self.new(sh, False, src=x)
            lines.append(f"{y} = {t}[{i}]")
            outs.append(y)
        self.emit(lines, [x], outs)
        # often stack/cat the items
        if len(outs) >= 2 and self.r.random() < 0.6:
            shp = self.vals[outs[0]]
            same = [o for o in outs if self.vals[o] == shp]
            if len(same) >= 2:
                if self.r.random() < 0.5:
                    y = self.new(shp[:1] + (len(same),) + shp[1:])
                    self.emit([f"{y} = torch.stack([{', '.join(same)}], dim=1)"], same, [y])
                else:
                    y = self.new(shp[:-1] + (shp[-1] * len(same),))
                    self.emit([f"{y} = torch.cat([{', '.join(same)}], dim=-1)"], same, [y])

    def op_cat(self):
        a = self.pick(lambda s: len(s) >= 2)
        s = self.vals[a]
        c = [n for n, t in self.vals.items() if t[:-1] == s[:-1]]
        k = self.r.sample(c, min(len(c), self.r.randrange(2, 4)))
        if a not in k:
            k[0] = a
        if self.r.random() < 0.5:
            y = self.new(s[:-1] + (sum(self.vals[n][-1] for n in k),))
            self.emit([f"{y} = torch.cat([{', '.join(k)}], dim=-1)"], k, [y])
        else:
            k = [n for n in k if self.vals[n] == s]
            y = self.new(s[:1] + (len(k),) + s[1:])
            self.emit([f"{y} = torch.stack([{', '.join(k)}], dim=1)"], k, [y])

    def op_matmul(self):
        q = self.pick(lambda s: len(s) == 3)
        if q is None:
            return
        s = self.vals[q]
        k = self.pick(lambda t: t == s, recent=False)
        v = self.pick(lambda t: len(t) == 3 and t[:2] == s[:2], recent=False)
        if self.r.random() < 0.5:
            y = self.new(s[:2] + (self.vals[v][2],))
            self.emit(
                [f"{y} = F.scaled_dot_product_attention({q}, {k}, {v}, is_causal={self.r.random() < 0.5})"],
                [q, k, v],
                [y],
            )
        else:
            a = self.new((s[0], s[1], s[1]))
            y = self.new(s[:2] + (self.vals[v][2],))
            self.emit(
                [f"{a} = torch.softmax({q} @ {k}.transpose(-1, -2) / 8.0, dim=-1)", f"{y} = torch.matmul({a}, {v})"],
                [q, k, v],
                [a, y],
            )

    def op_conv(self):
        x = self.pick(lambda s: len(s) == 3)
        if x is None:
            return
        s = self.vals[x]
        if self.r.random() < 0.6:
            c2 = self.r.choice([4, 8, 16])
            ln, ctor = self.layer(f"nn.Conv1d({s[1]}, {c2}, 3, padding=1)")
            y = self.new((s[0], c2, s[2]))
            self.emit([f"{y} = self.{ln}({x})"], [x], [y], [(ln, ctor)])
        else:
            c2 = self.r.choice([2, 4])
            ln, ctor = self.layer(f"nn.Conv2d(1, {c2}, 3, padding=1)")
            z = self.new((s[0], c2, s[1], s[2]))
            y = self.new((s[0], s[1], s[2]))
            self.emit([f"{z} = self.{ln}({x}.unsqueeze(1))", f"{y} = {z}.mean(dim=1)"], [x], [z, y], [(ln, ctor)])

    def op_reduce(self):
        x = self.pick(lambda s: len(s) >= 2)
        s = self.vals[x]
        y = self.new(s[:-1] + (1,))
        f = self.r.choice(["{}.sum(-1, keepdim=True)", "{}.mean(-1, keepdim=True)", "{}.amax(-1, keepdim=True)"])
        self.emit([f"{y} = " + f.format(x)], [x], [y])
        z = self.new(s)
        self.emit([f"{z} = {x} * {y}"], [x, y], [z])

    def build(self):
        r = self.r
        B = r.choice([4, 8, 12, 16])
        T = r.choice([4, 6, 8, 16])
        W = r.choice(WIDTHS)
        self.B = B
        x = self.new((B, T, W))
        self.noinplace.add(x)
        self.inputs = [x]
        self.inshapes = [(B, T, W)]
        # a first linear so things need grad
        self.op_linear()
        nops = r.randrange(6, 22)
        table = [
            (self.op_linear, 4),
            (self.op_act, 4),
            (self.op_inplace_fresh, 2),
            (self.op_inplace_existing, 1),
            (self.op_binary, 3),
            (self.op_addcmul, 1),
            (self.op_view, 4),
            (self.op_tuple, 2),
            (self.op_cat, 1),
            (self.op_matmul, 1.5),
            (self.op_conv, 1),
            (self.op_reduce, 1),
        ]
        fs, ws = zip(*table, strict=True)
        while len(self.ops) < nops:
            f = r.choices(fs, ws)[0]
            f()
        # segmentation
        nseg = r.randrange(2, 5)
        names = ["a", "b", "c", "d"][:nseg]
        cuts = sorted(r.sample(range(1, len(self.ops)), nseg - 1))
        bounds = [0] + cuts + [len(self.ops)]
        # outputs: final + maybe extra
        bvals = [n for n, s in self.vals.items() if len(s) >= 2 and s[0] == B and n not in self.noinplace]
        final = bvals[-1] if bvals else None
        return B, T, W, names, bounds, final

    def source(self):
        B, T, W, names, bounds, final = self.build()
        r = self.r
        defined_in = {}
        for i, (_, _, outs, _) in enumerate(self.ops):
            for o in outs:
                defined_in[o] = i
        used_after = {}
        for i, (_, ins, _, _) in enumerate(self.ops):
            for v in ins:
                used_after.setdefault(v, []).append(i)
        # extra outputs
        fs = self.vals[final]
        extra = [n for n in self.vals if n != final and n not in self.noinplace and r.random() < 0.08][:2]
        detach_out = r.random() < 0.3
        loss_kind = r.choice(["mse", "ce", "mse_self", "none"])
        top_uses = [final] + extra
        src = ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", "", ""]
        segio = []
        for si, nm in enumerate(names):
            lo, hi = bounds[si], bounds[si + 1]
            segops = self.ops[lo:hi]
            ins, outs = [], []
            for _, oi, _, _ in segops:
                for v in oi:
                    if (v in self.inputs or defined_in[v] < lo) and v not in ins:
                        ins.append(v)
            for _, _, oo, _ in segops:
                for v in oo:
                    later = [u for u in used_after.get(v, []) if u >= hi]
                    if later or v in top_uses:
                        outs.append(v)
            # in-place ops mutate objects; aliasing is fine as python semantics are kept
            segio.append((ins, outs))
            src.append(f"class Seg_{nm}(nn.Module):")
            src.append("    def __init__(self):")
            src.append("        super().__init__()")
            for _, _, _, layers in segops:
                for ln, ctor in layers:
                    src.append(f"        self.{ln} = {ctor}")
            src.append("")
            src.append(f"    def forward(self, {', '.join(ins)}):")
            for lines, _, _, _ in segops:
                for line in lines:
                    src.append("        " + line)
            src.append(f"        return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
            src.append("")
            src.append("")
        src.append("class Model(nn.Module):")
        src.append("    def __init__(self):")
        src.append("        super().__init__()")
        for nm in names:
            src.append(f"        self.{nm} = Seg_{nm}()")
        if loss_kind == "ce":
            src.append(f"        self.head = nn.Linear({fs[-1]}, 10)")
        src.append("")
        fwd_args = ["v0"] + (["target"] if loss_kind == "mse" else []) + (["labels"] if loss_kind == "ce" else [])
        src.append(f"    def forward(self, {', '.join(fwd_args)}):")
        for si, nm in enumerate(names):
            ins, outs = segio[si]
            lhs = ", ".join(outs) + ("," if len(outs) == 1 else "")
            if outs:
                src.append(f"        {lhs} = self.{nm}({', '.join(ins)})")
            else:
                src.append(f"        self.{nm}({', '.join(ins)})")
        rets = []
        if loss_kind == "mse":
            src.append(f"        loss = F.mse_loss({final}, target)")
            rets.append("loss")
        elif loss_kind == "mse_self":
            src.append(f"        loss = F.mse_loss({final}, torch.zeros_like({final}))")
            rets.append("loss")
        elif loss_kind == "ce":
            red = f"{final}" if len(fs) == 2 else f"{final}.mean(dim={tuple(range(1, len(fs) - 1))})"
            src.append(f"        logits = self.head({red})")
            src.append("        loss = F.cross_entropy(logits, labels)")
            rets.append("loss")
        if loss_kind in ("none",) or r.random() < 0.3:
            rets.append(final)
        rets += extra
        if detach_out:
            rets.append(f"{final}.detach()")
        src.append(f"        return ({', '.join(rets)},)")
        src.append("")
        src.append("")
        src.append("def make():")
        src.append("    torch.manual_seed(0)")
        src.append("    model = Model().train()")
        a = [f"torch.randn{self.inshapes[0]}"]
        if loss_kind == "mse":
            a.append(f"torch.randn{fs}")
        if loss_kind == "ce":
            a.append(f"torch.randint(0, 10, ({B},))")
        src.append(f"    args = ({', '.join(a)},)")
        src.append("    return model, args")
        src.append("")
        return "\n".join(src), names


def generate(seed):
    return G(seed).source()


if __name__ == "__main__":
    import sys

    print(generate(int(sys.argv[1]))[0])
