#!/usr/bin/python3
"""Reads a `./tandem up --config FILE.yaml` and prints one setting a line.

    up:      {prefill: 1, decode: 2}          # ./tandem up's own options
    decode:  {speculative: ngram, num_speculative_tokens: 4}
    router | prefill | gateway: {FLAG: VALUE}  # flags of that process

Output: SECTION<TAB>KEY<TAB>VALUE<TAB>LINE per setting, in file order (booleans as
true/false, other scalars exactly as written). A malformed file, an unknown section
or a value that is not a scalar: "FILE:LINE: why" on stderr and exit status 1.
Uses PyYAML (Debian's python3-yaml, on libyaml) with the safe loader only.
"""
import re
import sys

import yaml

SECTIONS = ("up", "router", "prefill", "decode", "gateway")
KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


class ConfigError(Exception):
    def __init__(self, node_or_mark, message):
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.line = mark.line + 1 if mark is not None else 0
        super().__init__(message)


def scalar_text(node):
    if node.tag == "tag:yaml.org,2002:null":
        raise ConfigError(node, "no value")
    if node.tag == "tag:yaml.org,2002:bool":
        return "true" if node.value.lower() in ("true", "yes", "on", "y") else "false"
    if any(c in node.value for c in "\t\n\r"):
        raise ConfigError(node, "values must be on one line, without tabs")
    return node.value


def settings(text):
    """Yields (section, key, value, line) for every setting of the document."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        raise ConfigError(e.problem_mark or e.context_mark,
                          "malformed YAML: " + (e.problem or e.context or "?"))
    except yaml.YAMLError as e:
        raise ConfigError(None, "malformed YAML: %s" % e)
    if root is None:
        return
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(root, "expected sections (%s) at the top" % ", ".join(SECTIONS))
    seen = set()
    for knode, body in root.value:
        name = knode.value if isinstance(knode, yaml.ScalarNode) else None
        if name not in SECTIONS:
            raise ConfigError(knode, "unknown section '%s' (known: %s)" %
                              (name, ", ".join(SECTIONS)))
        if name in seen:
            raise ConfigError(knode, "section '%s' appears twice" % name)
        seen.add(name)
        if isinstance(body, yaml.ScalarNode) and body.tag == "tag:yaml.org,2002:null":
            continue  # an empty section
        if not isinstance(body, yaml.MappingNode):
            raise ConfigError(body, "section '%s' must map flags to values" % name)
        keys = set()
        for fnode, vnode in body.value:
            key = fnode.value if isinstance(fnode, yaml.ScalarNode) else ""
            if not KEY.match(key):
                raise ConfigError(fnode, "'%s' is not a flag name" % key)
            if key.replace("-", "_") in keys:
                raise ConfigError(fnode, "%s.%s appears twice" % (name, key))
            keys.add(key.replace("-", "_"))
            if not isinstance(vnode, yaml.ScalarNode):
                raise ConfigError(vnode, "%s.%s: the value must be a single scalar" %
                                  (name, key))
            yield name, key, scalar_text(vnode), fnode.start_mark.line + 1


def main(argv):
    if len(argv) != 2:
        print("usage: up_config.py FILE.yaml", file=sys.stderr)
        return 2
    path = argv[1]
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        print("%s: cannot read: %s" % (path, getattr(e, "strerror", None) or e),
              file=sys.stderr)
        return 1
    try:
        rows = list(settings(text))
    except ConfigError as e:
        print("%s:%d: %s" % (path, e.line, e), file=sys.stderr)
        return 1
    for row in rows:
        print("%s\t%s\t%s\t%d" % row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
