"""Topic lists and templates of the code, chat and structured-output prompt sets."""

from __future__ import annotations

# ---- code ------------------------------------------------------------------------------------------

FUNCTION_TASKS = (
    "reverses the order of the words in a sentence",
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "counts how many times each word appears in a piece of text",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order",
    "flattens a nested list of any depth",
    "converts a temperature from Celsius to Fahrenheit",
    "finds the second largest number in a list",
    "groups a list of words by their first letter",
    "checks whether an email address looks valid using a simple regular expression",
    "turns a title like \"Hello World!\" into a URL slug like \"hello-world\"",
    "splits a list into chunks of size n",
    "returns the most common character in a string",
    "checks whether two strings are anagrams of each other",
    "converts a Roman numeral to an integer",
    "rotates a list to the right by k positions",
    "computes the factorial of n without recursion",
    "finds all pairs of numbers in a list that add up to a target",
    "capitalizes the first letter of every word in a string",
    "parses a URL query string into key/value pairs",
    "formats a number of seconds as HH:MM:SS",
    "computes the greatest common divisor of two integers",
    "transposes a matrix given as a list of rows",
    "recursively merges two nested dictionaries",
    "counts the vowels in a string",
    "returns the items two lists have in common, without duplicates",
    "generates a random password of a given length from letters and digits",
    "checks whether the brackets in a string are balanced",
    "does a binary search on a sorted list and returns the index, or -1 if the value is missing",
    "splits a CSV line into fields, keeping commas inside quotes",
    "computes the Levenshtein distance between two strings",
    "finds the longest common prefix of a list of strings",
    "retries another function up to three times with exponential backoff",
    "returns the number of days between two dates",
    "compresses a string like \"aaabcc\" into \"a3b1c2\"",
    "returns the k largest numbers in a list",
    "checks whether a year is a leap year",
    "masks all but the last four digits of a credit card number",
    "converts a snake_case string to camelCase",
    "adds up the digits of an integer",
    "sorts a list of people by age, and by name when the ages are equal",
    "reads a text file and returns its lines without trailing whitespace",
    "converts a decimal number to its binary representation as a string",
)
FUNCTION_TEMPLATES = (
    "Write a {lang} function that {x}.",
    "Can you write a {lang} function that {x}?",
    "I need a {lang} function that {x}.",
    "How would you write a function in {lang} that {x}?",
    "Show me a short {lang} function that {x}.",
    "What's the cleanest way to write a {lang} function that {x}?",
)
FUNCTION_EXTRAS = (
    "", "", "Add a short comment explaining how it works.", "Please include a couple of example calls.",
    "Keep it short and don't use any external libraries.", "Also tell me its time complexity.",
    "Make sure it handles edge cases.", "I'm a beginner, so keep it readable.",
)

SQL_TASKS = (
    "finds the top 5 customers by total order amount in an orders table",
    "counts how many employees work in each department",
    "returns the users who signed up in the last 30 days",
    "finds email addresses that appear more than once in a users table",
    "lists the products that have never been ordered",
    "shows the average salary for each job title, highest first",
    "gets the second highest salary from an employees table",
    "shows total revenue per month for the current year",
    "deletes rows older than 90 days from a logs table",
    "lists every order together with the name of the customer who placed it",
    "finds customers who have placed more than three orders",
    "ranks students by score within each class",
    "returns the most recent order for every customer",
    "calculates a running total of daily sales",
)
SQL_TEMPLATES = (
    "Write a SQL query that {x}.", "Can you give me a SQL query that {x}?",
    "I'm using PostgreSQL. Write a query that {x}.", "Using SQLite, how do I write a query that {x}?",
    "What would a SQL query look like that {x}?",
)
SQL_EXTRAS = ("", "", "Please explain each clause briefly.", "Assume sensible table and column names.",
               "Keep it to a single query if you can.")

BASH_TASKS = (
    "finds all .log files larger than 100 MB under /var/log",
    "renames every .jpeg file in a folder to .jpg",
    "counts the lines in all the Python files of a project",
    "prints the 10 largest files under the current directory",
    "deletes files older than 7 days from a temp folder",
    "checks whether a website returns HTTP 200 and prints a warning if it doesn't",
    "backs up a directory into a .tar.gz archive with today's date in the name",
    "pings each host in a list once and reports which ones are down",
    "replaces one word with another in every .txt file in a folder",
    "prints the unique IP addresses found in a web server access log",
    "waits until a TCP port is open before continuing",
    "shows how much disk space each subfolder uses, largest first",
)
BASH_TEMPLATES = (
    "Write a bash script that {x}.", "Give me a bash one-liner that {x}.", "What's a shell command that {x}?",
    "I need a bash script that {x}. It has to work on both Linux and macOS.",
    "How do I write a small bash script that {x}?",
)
BASH_EXTRAS = ("", "", "Please explain what each part does.", "Make it safe to run twice.",
                "Keep it short.")

# name -> (language, code, what it should do if it has a bug, else None)
SNIPPETS: dict[str, tuple[str, str, str | None]] = {
    "python mutable default": ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items",
                               "return a new one-item list whenever it's called without a list"),
    "python off by one": ("Python", "def sum_to(n):\n    total = 0\n    for i in range(n):\n        total += i\n"
                          "    return total", "add up the numbers from 1 to n"),
    "python remove while iterating": ("Python", "def remove_evens(nums):\n    for n in nums:\n"
                                      "        if n % 2 == 0:\n            nums.remove(n)\n    return nums",
                                      "remove every even number from the list"),
    "python input is a string": ("Python", "age = input(\"Age: \")\nif age >= 18:\n    print(\"adult\")",
                                 "print \"adult\" when the user is 18 or older"),
    "python late binding": ("Python", "funcs = [lambda: i for i in range(3)]\nprint([f() for f in funcs])",
                            "print [0, 1, 2]"),
    "python dict comprehension": ("Python", "squares = {n: n * n for n in range(10) if n % 2}", None),
    "python timing decorator": ("Python", "def timed(fn):\n    def wrapper(*args, **kwargs):\n"
                                "        start = time.perf_counter()\n        result = fn(*args, **kwargs)\n"
                                "        print(fn.__name__, time.perf_counter() - start)\n        return result\n"
                                "    return wrapper", None),
    "js var in loop": ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}",
                       "log 0, 1 and 2"),
    "js default sort": ("JavaScript", "const sorted = [10, 1, 5, 100].sort();\nconsole.log(sorted);",
                        "sort the numbers from smallest to largest"),
    "js async foreach": ("JavaScript", "async function total(ids) {\n  let sum = 0;\n  ids.forEach(async (id) => {\n"
                         "    sum += await fetchPrice(id);\n  });\n  return sum;\n}",
                         "add up the prices for all the ids"),
    "js set spread": ("JavaScript", "const unique = [...new Set(items)];", None),
    "js reduce cart": ("JavaScript", "const total = cart.reduce((sum, item) => sum + item.price * item.qty, 0);",
                       None),
    "js debounce": ("JavaScript", "function debounce(fn, ms) {\n  let timer;\n  return (...args) => {\n"
                    "    clearTimeout(timer);\n    timer = setTimeout(() => fn(...args), ms);\n  };\n}", None),
    "sql where aggregate": ("SQL", "SELECT department, COUNT(*)\nFROM employees\nWHERE COUNT(*) > 10\n"
                            "GROUP BY department;", "list the departments with more than 10 employees"),
    "sql equals null": ("SQL", "SELECT * FROM users WHERE email = NULL;", "find the users who have no email"),
    "sql window rank": ("SQL", "SELECT name, salary,\n"
                        "       RANK() OVER (PARTITION BY dept ORDER BY salary DESC) AS r\nFROM employees;", None),
    "sql anti join": ("SQL", "SELECT c.name\nFROM customers c\nLEFT JOIN orders o ON o.customer_id = c.id\n"
                      "WHERE o.id IS NULL;", None),
    "bash ls loop": ("Bash", "for f in $(ls *.txt); do\n  mv $f backup/$f\ndone",
                     "move every .txt file into backup/, even when the name has spaces"),
    "bash find xargs": ("Bash", "find . -name \"*.py\" -print0 | xargs -0 grep -l \"TODO\"", None),
    "bash dated tar": ("Bash", "tar -czf \"backup-$(date +%F).tar.gz\" ~/notes", None),
}
SNIPPET_TEMPLATES = {
    "explain": ("Explain what this {lang} snippet does:", "What does this {lang} code do?",
                "Can you walk me through this {lang} code line by line?",
                "I found this {lang} code in our repo. What is it for?"),
    "fix": ("Fix the bug in this {lang} code. It should {purpose}.",
            "This {lang} code is supposed to {purpose}, but it doesn't. What's wrong?",
            "Why doesn't this work? I want it to {purpose}.",
            "Can you find the bug? This should {purpose}, and I'm stuck."),
}


# ---- chat: kind -> (topics, templates); a comparison topic is "a|b" ------------------------------------

CHAT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "explain": ((
        "photosynthesis", "the immune system", "GPS", "a credit score", "compound interest", "inflation",
        "noise cancellation in headphones", "a refrigerator", "the stock market", "the electoral college", "a mortgage",
        "the greenhouse effect", "a heat pump", "the placebo effect", "natural selection", "plate tectonics",
        "a blockchain", "a nuclear power plant", "the water cycle", "a jet engine", "long-term memory",
        "an mRNA vaccine", "a solar panel", "the tide", "an electric car battery", "the Federal Reserve",
        "a search engine", "a microwave oven", "a rainbow", "carbon dating", "a 3D printer", "daylight saving time",
        "the human heart", "an index fund", "the cycle of the seasons", "a touchscreen", "the aurora borealis",
        "insulin",
        "public-key cryptography", "a hydroelectric dam",
    ), (
        "Can you explain how {x} works?", "How does {x} actually work?", "Explain {x} in simple terms.",
        "I've never really understood {x}. Could you explain it?", "Give me a short explanation of {x}.",
        "What's the basic idea behind {x}?",
    )),
    "advice": ((
        "learning to play the guitar", "training for a first 5k", "keeping houseplants alive",
        "negotiating a salary", "studying for exams", "saving money on groceries", "sleeping better",
        "speaking in public", "writing a cover letter", "learning a new language as an adult",
        "cooking rice on the stove",
        "starting a vegetable garden", "staying focused while working from home", "preparing for a job interview",
        "traveling on a budget", "making friends in a new city", "running a good meeting",
        "taking better photos with a phone", "giving feedback to a coworker", "house-training a puppy",
        "cutting down on screen time", "brewing good coffee at home", "buying a used car", "moving to a new apartment",
        "learning to swim as an adult", "keeping a journal", "baking bread for the first time",
        "meal prepping for the week", "paying off credit card debt", "getting back into exercise after a break",
    ), (
        "Any tips for {x}?", "I want to get better at {x}. Where should I start?",
        "What are some common mistakes people make when {x}?", "How should a beginner approach {x}?",
        "Give me a few practical tips for {x}.", "What's your best advice for {x}?",
    )),
    "define": ((
        "opportunity cost", "entropy", "dramatic irony", "cognitive dissonance", "a recession", "latency",
        "biodiversity", "confirmation bias", "a carbon footprint", "gerrymandering", "osmosis", "the Doppler effect",
        "stoicism", "a filibuster", "umami", "impostor syndrome", "net neutrality", "a tariff", "a dividend",
        "herd immunity", "supply and demand", "half-life", "the sunk cost fallacy", "a circadian rhythm",
        "a haiku", "an allele", "a hedge fund", "the butterfly effect", "a food desert", "an ecosystem",
    ), (
        "What does \"{x}\" mean?", "What is meant by {x}?", "Can you define {x} and give an example?",
        "I keep hearing about {x}. What is it?", "Explain the term \"{x}\" in a sentence or two.",
        "What's a simple definition of {x}?",
    )),
    "compare": ((
        "weather|climate", "a virus|a bacterium", "stocks|bonds", "a crocodile|an alligator",
        "baking soda|baking powder", "a hurricane|a tornado", "empathy|sympathy", "a Roth IRA|a traditional IRA",
        "RAM|storage", "a latte|a cappuccino", "an asteroid|a comet", "a psychologist|a psychiatrist",
        "affect|effect", "a lake|a pond", "mass|weight", "speed|velocity", "an ETF|a mutual fund",
        "a simile|a metaphor", "LED bulbs|incandescent bulbs", "a credit card|a debit card", "renting|buying a home",
        "a frog|a toad", "Wi-Fi|Bluetooth", "a sprain|a strain", "an ale|a lager", "nuclear fission|nuclear fusion",
        "a will|a trust", "a cold|the flu", "a democracy|a republic", "an LLC|a sole proprietorship",
    ), (
        "What's the difference between {a} and {b}?", "How is {a} different from {b}?",
        "{a} versus {b}: how do they differ?", "Can you compare {a} and {b}?",
        "I always mix up {a} and {b}. How can I tell them apart?",
    )),
    "history": ((
        "the fall of the Berlin Wall", "the French Revolution", "the Apollo 11 moon landing",
        "the invention of the printing press", "the Black Death", "the Industrial Revolution",
        "the building of the Panama Canal", "the Cuban Missile Crisis", "the signing of the Magna Carta",
        "the fall of the Western Roman Empire", "the Meiji Restoration", "the decline of the Silk Road",
        "the Great Depression", "the partition of India", "the Protestant Reformation",
        "the Wright brothers' first flight", "the discovery of penicillin", "the Marshall Plan",
        "the end of apartheid in South Africa", "the Columbian Exchange",
    ), (
        "What led to {x}?", "Give me a short overview of {x}.", "Why was {x} so important?",
        "What were the main consequences of {x}?", "Summarize {x} in a few sentences.",
        "I'm reading about {x}. What should I know?",
    )),
}
CHAT_COMMON = ("", "", "Keep it short.", "Explain it like I'm 12.", "A few bullet points are fine.",
                "I'm studying for an exam, so be precise.")
CHAT_EXTRAS = {
    "explain": CHAT_COMMON + ("Use an everyday analogy if you can.", "I have a science background, so you can be "
                               "a bit technical."),
    "advice": ("", "", "I only have about 30 minutes a day.", "I'm a complete beginner.", "Keep the list short.",
               "I'm on a tight budget."),
    "define": CHAT_COMMON + ("Where does the term come from?",),
    "compare": CHAT_COMMON + ("A small table would help.",),
    "history": CHAT_COMMON + ("Include the key dates.",),
}


# ---- structured: plural -> (one, fields); format -> templates ------------------------------------------

RECORDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "books": ("a book", ("title", "author", "year published", "genre", "page count")),
    "employees": ("an employee", ("name", "department", "start date", "salary", "manager")),
    "recipes": ("a recipe", ("name", "servings", "prep time", "ingredients", "steps")),
    "products": ("a product", ("name", "SKU", "price", "stock count", "category")),
    "cities": ("a city", ("name", "country", "population", "time zone", "year founded")),
    "movies": ("a movie", ("title", "director", "release year", "runtime in minutes", "rating")),
    "planets": ("a planet", ("name", "distance from the sun", "number of moons", "diameter", "rings")),
    "laptops": ("a laptop", ("brand", "model", "CPU", "RAM", "storage", "price")),
    "restaurants": ("a restaurant", ("name", "cuisine", "address", "price range", "rating")),
    "flights": ("a flight", ("flight number", "origin", "destination", "departure time", "gate")),
    "students": ("a student", ("name", "student ID", "grade", "email", "major")),
    "exercises": ("an exercise", ("name", "sets", "reps", "rest in seconds", "muscle group")),
    "events": ("an event", ("title", "date", "location", "organizer", "capacity")),
    "songs": ("a song", ("title", "artist", "album", "duration", "release year")),
    "pets": ("a pet", ("name", "species", "breed", "age", "vaccinated")),
    "job postings": ("a job posting", ("title", "company", "location", "salary range", "remote")),
    "hotels": ("a hotel", ("name", "city", "star rating", "nightly rate", "amenities")),
    "used cars": ("a used car", ("make", "model", "year", "mileage", "price")),
    "countries": ("a country", ("name", "capital", "currency", "official languages", "population")),
    "support tickets": ("a support ticket", ("ticket ID", "customer", "priority", "status", "created at")),
    "conference talks": ("a conference talk", ("speaker", "title", "track", "room", "start time")),
    "houseplants": ("a houseplant", ("common name", "Latin name", "light needs", "watering schedule", "pet-friendly")),
    "bank transactions": ("a bank transaction", ("date", "description", "amount", "category", "balance")),
    "podcast episodes": ("a podcast episode", ("show", "episode number", "title", "guest", "length")),
    "university courses": ("a university course", ("course code", "title", "instructor", "credits", "schedule")),
    "board games": ("a board game", ("name", "number of players", "play time", "minimum age", "publisher")),
    "servers": ("a server", ("hostname", "IP address", "operating system", "CPU cores", "memory")),
    "user accounts": ("a user account", ("username", "email", "role", "created at", "active")),
    "invoice lines": ("an invoice line", ("item", "quantity", "unit price", "tax rate", "total")),
    "museums": ("a museum", ("name", "city", "year founded", "famous works", "ticket price")),
    "hiking trails": ("a hiking trail", ("name", "length in km", "elevation gain", "difficulty", "region")),
    "coffee orders": ("a coffee order", ("customer name", "drink", "size", "milk", "extra shots")),
    "sports teams": ("a sports team", ("name", "city", "league", "year founded", "home stadium")),
    "smartphones": ("a smartphone", ("brand", "model", "screen size", "battery capacity", "price")),
}
FORMATS = {
    "json": ("Give me a JSON object for {one} with the fields {fields}.",
             "Create a sample JSON record for {one} with these keys: {cols}.",
             "Generate a JSON array of {n} {many}, each with {fields}."),
    "yaml": ("Write a YAML file that lists {n} {many} with {fields} for each.",
             "Show me {one} as YAML with the keys {cols}."),
    "csv": ("Make a CSV with a header row and {n} rows of made-up {many}. Columns: {cols}.",
            "Give me sample CSV data for {n} {many} ({cols})."),
    "markdown table": ("Create a markdown table of {n} {many} with columns for {fields}.",
                       "Put {n} example {many} in a markdown table with {fields}."),
    "list": ("List {n} {many} as bullet points, each showing {fields}.",
             "Write a numbered list of {n} {many}, giving {fields} for each one."),
}
STRUCTURED_EXTRAS = ("", "", "Use realistic but made-up values.", "No explanation, just the output.",
                      "Keep the values short.")
FORMAT_EXTRAS = {"json": ("Use snake_case for the keys.", "Make sure it's valid JSON."),
                  "yaml": ("Use snake_case for the keys.",), "csv": ("Quote any value that contains a comma.",)}
